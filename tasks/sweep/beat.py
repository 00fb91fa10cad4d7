"""The beat sweep: find work whose holder died or overran, and put it right.

Runs on the ``maint`` queue every ``sweep_interval_s``. For every job whose stage is running:

- the stage ran past its budget (plus one lease period of grace): the job ends ``timeout`` and
  its sandbox is closed, even if the stage's worker is stuck and never looks at its budget;
- the stage's lease lapsed, so its worker died: the chain is sent again from that stage (the
  redelivery resumes from the saved state, or ends the job ``failed`` once the stage used up its
  attempts).

Jobs waiting for their next stage whose message the broker lost get it again
(:mod:`tasks.sweep.requeue`), sandboxes and sandbox hosts are reconciled with the jobs
(:mod:`tasks.sweep.sandboxes`), and LLM backends paused past their ``paused_until`` with no resume
are resumed on the weights they had (:func:`prorl_celery.llm.control.expire_pauses`: turns frozen
in a server wait in no process that could notice).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.celery_app import app
from prorl_celery.connections import get_store
from prorl_celery.jobs import JobRecord, JobStore
from prorl_celery.llm.control import expire_pauses
from prorl_celery.llm.registry import BackendRegistry
from prorl_celery.metrics import count_sweep
from prorl_celery.models import ErrorInfo
from prorl_celery.status import STAGES, JobStatus, StageState
from sandboxes.client import close_handle
from tasks.chain import dispatch, send_chain
from tasks.outcome import finish
from tasks.sweep.requeue import requeue_lost
from tasks.sweep.sandboxes import sweep_sandboxes
from tasks.stages import stage_budget

log = logging.getLogger(__name__)


def in_stages(store: JobStore) -> list[JobRecord]:
    """Every job in init, run or eval: running its stage, or done with it and waiting for the next.
    Light records (no instance, state or result): a sweep every few seconds must not read every
    rollout's conversation."""
    ids = [job_id for stage in STAGES for job_id in store.ids_in(stage)]
    return [r for r in store.get_many(ids, light=True) if r is not None and not r.status.terminal]


def end_overrun(store: JobStore, record: JobRecord, now: float) -> bool:
    stage = record.status
    over = now - record.t_stage_start - stage_budget(record, stage)
    if over < get_settings().stage_lease_s:
        return False
    seen, record = record, store.get(record.job_id)  # the whole record: its result keeps what the stage did
    if record is None or (record.status, record.attempt, record.t_stage_start) != (stage, seen.attempt,
                                                                                    seen.t_stage_start):
        return False  # moved on since the scan
    record.add_stage_time(stage, now - record.t_stage_start)
    message = f"{stage} stage ran {over:.0f}s past its budget; ended by the sweep"
    # Narrowed to the overrun stage: had it finished since the read, the next stage is not ended.
    result = finish(store, record, JobStatus.TIMEOUT, critical_error="timeout",
                    error=ErrorInfo(type="timeout", message=message), fields={"stage": stage.value},
                    sources=[stage], expect_attempt=record.attempt)
    if result is not None and record.sandbox:
        close_handle(record.sandbox)  # logged, never raised: the host's lease is the backstop
    return result is not None


def leased(store: JobStore, records: list[JobRecord], now: float) -> set[str]:
    """The jobs among ``records`` whose stage lease is held, asked in one round trip of those
    running longer than a lease (a younger stage's lease cannot have lapsed yet: counted held)."""
    lease_s = get_settings().stage_lease_s
    old = [r.job_id for r in records if now - r.t_stage_start >= lease_s]
    pipe = store.redis.pipeline(transaction=False)
    for job_id in old:
        pipe.exists(keys.stage_lease(job_id))
    found = pipe.execute() if old else []
    return {r.job_id for r in records} - {job_id for job_id, there in zip(old, found) if not there}


def redispatch_lapsed(store: JobStore, record: JobRecord, now: float, held: set[str]) -> bool:
    """Send the chain again from a running stage whose lease lapsed (``held``: :func:`leased`)."""
    if now - record.t_stage_start < get_settings().stage_lease_s:
        return False
    if record.job_id in held:
        return False
    # The status stays (target None), narrowed to the stage whose lease lapsed.
    ok, _ = store.transition(record.job_id, None, sources=[record.status], require_state=StageState.RUNNING,
                             expect={"attempt": record.attempt}, stage_state=StageState.REDISPATCHED,
                             t_enqueued=now)
    if ok:
        send_chain(record.job_id, record.data_source, start=record.status)
    return ok


def sweep_once(store: JobStore, now: float | None = None) -> dict[str, list[str]]:
    now = now or time.time()
    report: dict[str, list[str]] = {"timed_out": [], "redispatched": []}
    active = in_stages(store)
    running = [r for r in active if r.stage_state is StageState.RUNNING]
    held = leased(store, running, now)
    for record in running:
        if end_overrun(store, record, now):
            report["timed_out"].append(record.job_id)
        elif redispatch_lapsed(store, record, now, held):
            report["redispatched"].append(record.job_id)
    report["requeued"] = requeue_lost(store, active, now)
    report["released"] = dispatch(store)  # fair share's backstop: a quota freed by an end nobody saw
    report.update(sweep_sandboxes(store, now))  # hosts, their sandboxes, singularity instances
    report["pauses_expired"] = expire_pauses(BackendRegistry(store.redis), now)
    for action, ids in report.items():
        if ids:
            log.warning("sweep %s %d job(s): %s", action, len(ids), ids)
    return report


@app.task(name="prorl.sweep", ignore_result=True)  # nobody reads it; beat then never waits on the result backend
def sweep() -> dict[str, Any]:
    """One sweep pass; returns what it did (also logged)."""
    store = get_store()
    report = sweep_once(store)
    counts = {action: len(ids) for action, ids in report.items()}
    count_sweep(store.redis, counts)
    return {"counts": counts, **report}
