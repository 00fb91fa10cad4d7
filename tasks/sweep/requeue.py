"""Backstop for stage messages the broker lost.

Kombu's Redis transport takes a message off its queue and records it as unacknowledged in two
steps; a Redis crash between them, or a consumer whose connection died with messages prefetched,
can leave a job waiting for a stage whose message no longer exists anywhere (found in testing by
killing Redis mid-batch). Such a job would wait forever, or until the visibility timeout (hours).

The sweep looks for jobs that have waited for their next stage longer than
``stage_requeue_after_s`` and, for each stage queue where fewer messages exist (in the queue plus
held by live workers) than jobs wait, sends the missing ones again. A message that was only
delayed, not lost, becomes a duplicate, which the stage tasks ignore (design decision 1).
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from kombu.exceptions import ChannelError
from kombu.utils.json import loads

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.celery_app import app
from prorl_celery.jobs import JobRecord, JobStore
from prorl_celery.status import STAGES, JobStatus, StageState, next_stage
from tasks.chain import send_chain, task_id

log = logging.getLogger(__name__)


@dataclass
class _Waiting:
    job_id: str
    data_source: str
    t_enqueued: float


def awaited_stage(record: JobRecord) -> JobStatus | None:
    """The stage a job waits for, or None if it is not waiting for one."""
    if record.status is JobStatus.QUEUED:
        return JobStatus.INIT
    if record.stage_state is StageState.DONE and next_stage(record.status) in STAGES:
        return next_stage(record.status)
    if record.stage_state is StageState.REDISPATCHED:  # the sweep re-sent this stage; that message may be lost too
        return record.status
    return None


def _held_by_workers() -> set[str]:
    """Ids of tasks that live workers have reserved while all their threads are busy: they run
    once a thread frees. Not the tasks workers call active: a stage that really runs takes its
    lease and leaves the waiting state at once, so a job still waiting past the requeue delay
    has no live delivery. Both were seen after a broker reconnect: a reserved request on a
    worker with idle threads that never ran, and an active one that had died with the connection
    (the thread pool cannot cancel it) and stayed listed as active."""
    inspect = app.control.inspect(timeout=1.0)
    active, reserved, stats = inspect.active() or {}, inspect.reserved() or {}, inspect.stats() or {}
    held: set[str] = set()
    for worker, tasks in reserved.items():
        slots = (stats.get(worker) or {}).get("pool", {}).get("max-concurrency", 0)
        if len(active.get(worker, [])) >= slots:
            held.update(task["id"] for task in tasks)
    return held


def queue_length(channel: Any, queue: str) -> int:
    """Messages waiting in ``queue``, as the broker's transport counts them (a passive declare:
    kombu's Redis transport sums the queue's priority lists)."""
    try:
        return channel.queue_declare(queue=queue, passive=True).message_count
    except ChannelError:  # NOT_FOUND: Redis keeps no key for an empty list
        return 0


def task_ids_in(channel: Any, queue: str) -> set[str]:
    """Ids of the tasks whose messages wait in ``queue``, read without taking them. Neither
    Celery nor kombu can look into a queue without consuming, so the list is read as it lies;
    each entry is decoded by the transport's own message class (envelope, body encoding) and
    the id taken from the task protocol's headers."""
    ids = set()
    for raw in channel.client.lrange(queue, 0, -1):
        try:
            ids.add(channel.Message(loads(raw), channel=channel).headers["id"])
        except (ValueError, KeyError, TypeError):
            continue
    return ids


def _queued(store: JobStore) -> list[_Waiting]:
    """Jobs waiting for init, read lightly (a backlog can be large); a project's job only once fair
    share released it."""
    ids = store.ids_in(JobStatus.QUEUED)
    pipe = store.redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(keys.job(job_id), "status", "data_source", "t_enqueued", "project", "t_released")
    out = []
    for job_id, (status, source, enqueued, project, released) in zip(ids, pipe.execute()):
        if project and not released:
            continue  # pending in its project's fair-share list: no message was sent yet
        if status == b"queued" and source and enqueued:
            out.append(_Waiting(job_id, source.decode(), float(enqueued)))
    return out


def requeue_lost(store: JobStore, active: list[JobRecord], now: float | None = None) -> list[str]:
    """Re-send the next stage of waiting jobs whose message exists nowhere; returns their ids.

    ``active``: the records of jobs in init, run or eval (those waiting for their next stage are
    picked from them); jobs waiting for init are read here."""
    now = now or time.time()
    after = get_settings().stage_requeue_after_s
    by_stage: dict[JobStatus, list[_Waiting]] = defaultdict(list)
    by_stage[JobStatus.INIT] = _queued(store)
    for record in active:
        stage = awaited_stage(record)
        if stage is not None and not (stage is JobStatus.INIT and record.status is JobStatus.QUEUED):
            by_stage[stage].append(_Waiting(record.job_id, record.data_source, record.t_enqueued))
    stale = {stage: [w for w in items if now - w.t_enqueued > after] for stage, items in by_stage.items()}
    if not any(stale.values()):
        return []
    held = _held_by_workers()
    with app.connection_for_read() as connection:
        return _resend(connection.default_channel, by_stage, stale, held, after)


def _resend(channel: Any, by_stage: dict[JobStatus, list[_Waiting]], stale: dict[JobStatus, list[_Waiting]],
            held: set[str], after: float) -> list[str]:
    sent = []
    for stage in STAGES:
        if not stale.get(stage):
            continue
        queued = queue_length(channel, stage.value)
        held_here = sum(1 for tid in held if tid.endswith(f":{stage.value}"))
        if queued + held_here >= len(by_stage[stage]):
            log.info("%d job(s) waited over %gs for %s; %d message(s) queued and %d held by workers "
                     "cover all %d waiting", len(stale[stage]), after, stage, queued, held_here,
                     len(by_stage[stage]))
            continue  # every waiting job can still have its message
        present = task_ids_in(channel, stage.value) | held
        for record in stale[stage]:
            if task_id(record.job_id, stage) not in present:
                send_chain(record.job_id, record.data_source, start=stage)
                sent.append(record.job_id)
    if sent:
        log.warning("re-sent %d stage message(s) the broker lost: %s", len(sent), sent)
    return sent
