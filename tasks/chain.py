"""Submitting jobs as chains and cancelling them."""
from __future__ import annotations

import uuid
from typing import Iterable

from celery import chain

from prorl_celery.celery_app import app
from prorl_celery.errors import JobAlreadyTerminal, JobIdConflict, UnknownJob
from prorl_celery.fairshare import FairShare
from prorl_celery.jobs import JobRecord, JobStore, request_digest
from prorl_celery.models import ErrorInfo, JobRequest
from prorl_celery.status import STAGES, JobStatus, StageState, next_stage
from tasks.handlers import sandbox_needs
from tasks.outcome import finish_many

_TASK_NAMES = {stage: f"prorl.{stage.value}" for stage in STAGES}  # as tasks/stages.py names them


def task_id(job_id: str, stage: JobStatus) -> str:
    return f"{job_id}:{stage.value}"


def _link(job_id: str, data_source: str, stage: JobStatus) -> dict:
    """One immutable link, as a chain message carries it."""
    return {"task": _TASK_NAMES[stage], "args": [job_id], "kwargs": {"data_source": data_source},
            "options": {"task_id": task_id(job_id, stage)},
            "subtask_type": None, "immutable": True}


def stage_chain(job_id: str, data_source: str, start: JobStatus = JobStatus.INIT) -> chain:
    """``init.si(job_id) | run.si(job_id) | eval.si(job_id)`` from ``start`` on, with
    deterministic task ids. The data source rides along only so Flower shows it."""
    return chain(*(app.signature(_link(job_id, data_source, stage)) for stage in STAGES[STAGES.index(start):]))


def send_chain(job_id: str, data_source: str, start: JobStatus = JobStatus.INIT, producer=None) -> None:
    """Send :func:`stage_chain` as ``chain.apply_async`` would, without building it: the first
    link's message carries the others, last first. Several times cheaper per job, which counts
    when a trainer submits thousands at once."""
    stages = STAGES[STAGES.index(start):]
    links = [_link(job_id, data_source, stage) for stage in reversed(stages)]
    first = links.pop()
    app.send_task(first["task"], args=first["args"], kwargs=first["kwargs"], chain=links,
                  producer=producer, **first["options"])


def submit(store: JobStore, requests: Iterable[JobRequest], project: str | None = None) -> list[str]:
    """Store and enqueue jobs owned by ``project`` (None: the operator's; a project's wait in its
    fair-share list until released, each with its sandbox need, and OverQuota, or PolicyDenied for
    a job needing more sandboxes than the project may hold, is raised before anything is stored). A job id already known
    for the same request of the same project (a retry) is returned but not run again; one known
    for a different request (or another project's) raises :class:`JobIdConflict`, and then
    nothing of the batch is stored (unless another submission took the id meanwhile: the jobs new
    here still run, and the conflict is still raised)."""
    named = [(req.job_id or uuid.uuid4().hex, req) for req in requests]
    _refuse_conflicts(store, [(job_id, req) for job_id, req in named if req.job_id], project)
    needs = None
    if project:  # pending in fair share first (or OverQuota: nothing stored), released below
        needs = sandbox_needs([req.instance for _, req in named])
        FairShare(store.redis).enqueue(project, [(job_id, req.priority, need)
                                                 for (job_id, req), need in zip(named, needs)])
    created = store.create_many(named, project, needs=needs)
    if project:
        dispatch(store)
    else:
        with app.producer_or_acquire() as producer:
            for (job_id, req), new in zip(named, created):
                if new:
                    send_chain(job_id, req.instance["data_source"], producer=producer)
    _refuse_conflicts(store, [(job_id, req) for (job_id, req), new in zip(named, created) if not new], project)
    return [job_id for job_id, _ in named]


def dispatch(store: JobStore, started: str | None = None) -> list[str]:
    """Release what fair share allows now (:mod:`prorl_celery.fairshare`) and send their chains;
    returns the released job ids. ``started``: a job whose stage just began."""
    released = FairShare(store.redis).release(started)
    if released:
        with app.producer_or_acquire() as producer:
            for job_id, data_source in released:
                send_chain(job_id, data_source, producer=producer)
    return [job_id for job_id, _ in released]


def _refuse_conflicts(store: JobStore, named: list[tuple[str, JobRequest]], project: str | None) -> None:
    """Raise :class:`JobIdConflict` for the first job id stored for another request than its own."""
    if not named:
        return
    for (job_id, req), stored in zip(named, store.digests([job_id for job_id, _ in named])):
        if stored is not None and stored != request_digest(req, project):
            raise JobIdConflict(job_id)


def cancel(store: JobStore, job_id: str, reason: str = "cancelled by request") -> JobRecord:
    """End a job ``cancelled``: record the typed result with what it did so far, revoke its
    chain, and close its sandbox (which also kills a running command)."""
    record = store.get(job_id)
    if record is None:
        raise UnknownJob(job_id)
    if record.status.terminal:
        raise JobAlreadyTerminal(job_id, record.status.value)
    if not cancel_many(store, [record], reason):
        status = store.status(job_id)
        raise JobAlreadyTerminal(job_id, status.value if status else "unknown")
    return store.get(job_id) or record


def cancel_many(store: JobStore, records: list[JobRecord], reason: str = "cancelled by request") -> list[str]:
    """Cancel every job of ``records`` that is still active; returns the ids it cancelled.

    The typed results are written first (one store round trip), so that a stage whose sandbox
    dies under it finds its job ended; then their sandboxes are closed in bulk
    (:func:`sandboxes.client.close_handles`), and last one revoke broadcast covers the links
    that may wait in a queue (:func:`queued_links`)."""
    from sandboxes.client import close_handles  # here: the API imports this module

    error = ErrorInfo(type="cancelled", message=reason)
    active = [r for r in records if not r.status.terminal]
    ends = [(r, {"critical_error": "cancelled", "error": error, "fields": {"stage": r.stage}}) for r in active]
    results = finish_many(store, ends, JobStatus.CANCELLED)
    cancelled = {r.job_id: r for r, result in zip(active, results) if result is not None}
    if not cancelled:
        return []
    close_handles(_sandboxes_of(store, list(cancelled.values())))
    if links := queued_links(cancelled.values()):
        app.control.revoke(links)
    if any(r.project for r in cancelled.values()):
        FairShare(store.redis).forget((r.project, r.job_id) for r in cancelled.values()
                                      if r.project and r.status is JobStatus.QUEUED)
        dispatch(store)  # their quotas and queue places are free
    return list(cancelled)


def _sandboxes_of(store: JobStore, records: list[JobRecord]) -> list[dict]:
    """The sandboxes of jobs just ended. A job past init keeps the one its init opened, as read;
    a queued or initialising one is read again: its init may have stored a sandbox since (a
    sandbox started after the end is closed by the init that started it)."""
    early = {JobStatus.QUEUED, JobStatus.INIT}
    again = [r.job_id for r in records if r.status in early]
    return [r.sandbox for r in records if r.status not in early and r.sandbox] + \
        [r.sandbox for r in store.get_many(again) if r and r.sandbox]


def queued_links(records: Iterable[JobRecord]) -> list[str]:
    """The task ids of the links that may wait in a queue for these jobs (as they were before
    they ended): the current stage's unless a delivery runs it, the next one's once it is done.

    A running stage is not revoked: a thread pool cannot terminate it, and it ends itself at the
    store's next word (the result is terminal). A later link is never sent: its stage before
    ends the chain when it finds the job ended (tasks/stages.py ``_ended``). So the revoke names only messages a
    worker would otherwise take, and stays small: Celery's workers each look up the backend
    state of every revoked id (and write one for an unsent link), which for a bulk cancel of
    1,000 running rollouts was 3,000 round trips per worker while their sandboxes were dying."""
    links = []
    for record in records:
        state, status = record.stage_state, record.status
        if status is JobStatus.QUEUED:
            links.append(task_id(record.job_id, JobStatus.INIT))
        elif state is StageState.DONE:
            if next_stage(status) in STAGES:
                links.append(task_id(record.job_id, next_stage(status)))
        elif state is not StageState.RUNNING and status in STAGES:
            links.append(task_id(record.job_id, status))
    return links


def active_jobs(store: JobStore) -> list[JobRecord]:
    """Every job not yet terminal."""
    ids = [job_id for status in JobStatus if not status.terminal for job_id in store.ids_in(status)]
    return [r for r in store.get_many(ids) if r is not None]
