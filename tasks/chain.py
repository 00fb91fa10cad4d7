"""Submitting jobs as chains and cancelling them."""
from __future__ import annotations

import logging
import uuid
from typing import Iterable

from celery import chain

from prorl_celery.celery_app import app
from prorl_celery.errors import JobAlreadyTerminal, UnknownJob
from prorl_celery.jobs import JobRecord, JobStore
from prorl_celery.models import ErrorInfo, JobRequest
from prorl_celery.status import STAGES, JobStatus
from tasks.outcome import finish

log = logging.getLogger(__name__)
_TASK_NAMES = {JobStatus.INIT: "prorl.init", JobStatus.RUN: "prorl.run", JobStatus.EVAL: "prorl.eval"}


def task_id(job_id: str, stage: JobStatus) -> str:
    return f"{job_id}:{stage.value}"


def stage_chain(job_id: str, data_source: str, start: JobStatus = JobStatus.INIT) -> chain:
    """``init.si(job_id) | run.si(job_id) | eval.si(job_id)`` from ``start`` on, with
    deterministic task ids. The data source rides along only so Flower shows it."""
    links = [app.signature(_TASK_NAMES[stage], args=(job_id,), kwargs={"data_source": data_source},
                           immutable=True).set(task_id=task_id(job_id, stage))
             for stage in STAGES[STAGES.index(start):]]
    return chain(*links)


def submit(store: JobStore, requests: Iterable[JobRequest]) -> list[str]:
    """Store and enqueue jobs; a job id that is already known is returned but not run again."""
    named = [(req.job_id or uuid.uuid4().hex, req) for req in requests]
    created = store.create_many(named)
    with app.producer_or_acquire() as producer:
        for (job_id, req), new in zip(named, created):
            if new:
                stage_chain(job_id, req.instance["data_source"]).apply_async(producer=producer)
    return [job_id for job_id, _ in named]


def cancel(store: JobStore, job_id: str, reason: str = "cancelled by request") -> JobRecord:
    """End a job ``cancelled``: record the typed result with what it did so far, revoke its
    chain, and close its sandbox (which also kills a running command)."""
    record = store.get(job_id)
    if record is None:
        raise UnknownJob(job_id)
    if record.status.terminal:
        raise JobAlreadyTerminal(job_id, record.status.value)
    result = finish(store, record, JobStatus.CANCELLED, critical_error="cancelled",
                    error=ErrorInfo(type="cancelled", message=reason),
                    fields={"stage": record.stage})
    if result is None:
        status = store.status(job_id)
        raise JobAlreadyTerminal(job_id, status.value if status else "unknown")
    app.control.revoke([task_id(job_id, stage) for stage in STAGES])
    _close_sandbox(store, job_id)
    return store.get(job_id) or record


def _close_sandbox(store: JobStore, job_id: str) -> None:
    from sandboxes.base import SandboxHandle
    from sandboxes.client import close_handle

    record = store.get(job_id)
    if record and record.sandbox:
        try:
            close_handle(SandboxHandle.model_validate(record.sandbox))
        except Exception as exc:  # noqa: BLE001 - the host's lease reaper is the backstop
            log.warning("closing sandbox of cancelled job %s failed: %s", job_id, exc)
