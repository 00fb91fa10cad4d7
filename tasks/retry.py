"""Infrastructure faults cost a retry, not a sample.

A stage that fails because of the infrastructure — its sandbox host died or restarted (the
sandbox is gone or unreachable), its worker was lost more often than ``stage_max_attempts``, an
LLM outage outlasted the pool's retry budget — does not end the job. The job goes back to
``queued`` with a fresh state (nothing of the failed attempt reaches the result) and runs again
from init, where placement skips a host that does not answer, until ``job_max_attempts`` runs
ended that way; then it ends ``failed`` with every attempt listed in ``result.attempts``.

Faults of the task itself (a command that fails, a grader that raises, a budget overrun, a
request the LLM server rejects, a context window that is full) are not retried.

The move back to ``queued`` is one compare-and-set on the attempt (the transition table lets any
stage go back to ``queued``), so a worker and the sweep that both see the same fault retry the
job once, and no write of an earlier attempt lands in a later one (every stage write names its
attempt).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from config.settings import get_settings
from prorl_celery.errors import (BackendFailed, BackendUnavailable, ContextWindowExceeded,
                                 LLMRequestRejected, LLMTimeout, SandboxError)
from prorl_celery.jobs import JobRecord, JobStore
from prorl_celery.models import Attempt, ErrorInfo
from prorl_celery.status import JobStatus, StageState
from tasks.outcome import finish

log = logging.getLogger(__name__)
WORKER_LOST = "worker_lost"
HOST_LOST = "sandbox_host_lost"
HOST_UNREACHABLE = "sandbox_host_unreachable"
_TASK_LLM_FAULTS = (ContextWindowExceeded, LLMRequestRejected, LLMTimeout)


def infrastructure_fault(exc: BaseException) -> str | None:
    """The fault type when ``exc`` is the infrastructure's doing (retried from init), else None."""
    from prorl_celery.http import TransportError

    if isinstance(exc, SandboxError):
        return HOST_UNREACHABLE if isinstance(exc.__cause__, TransportError) else exc.type
    if isinstance(exc, _TASK_LLM_FAULTS):
        return None
    if isinstance(exc, (BackendUnavailable, BackendFailed)):
        return exc.type
    return None


def critical_for(fault: str, stage: str | None) -> str:
    """The result's ``critical_error`` when retries of ``fault`` ran out."""
    if fault == WORKER_LOST:
        return stage or "run"
    return "llm" if fault.startswith(("backend", "llm", "logprob")) else "sandbox"


def attempt_entry(record: JobRecord, fault: str | None, message: str = "",
                  stage: str | None = None) -> dict[str, Any]:
    host = (record.sandbox or {}).get("host_id")
    return Attempt(attempt=record.attempt, stage=stage or record.stage, fault=fault,
                   message=message[:500], host=host).model_dump(mode="json")


@dataclass
class Requeued:
    """A job sent back to ``queued``; :meth:`send` (once the stage's lease is released, so the
    new init can take it) enqueues its new chain."""

    job_id: str
    data_source: str

    def send(self) -> None:
        from tasks.chain import send_chain

        send_chain(self.job_id, self.data_source)


def retry_from_init(store: JobStore, record: JobRecord, fault: str, message: str,
                    stage: str | None = None, handler: Any = None) -> Requeued | dict[str, Any] | None:
    """Record ``fault`` as the end of the record's attempt; send the job back to ``queued`` if
    attempts remain (returns :class:`Requeued`; the caller sends it), else end it ``failed``
    (returns its result). None when the job had moved on meanwhile (another attempt, or ended).
    The attempt's sandbox is the caller's to close; a stage passes its ``handler`` for the result."""
    faults = [*record.faults, attempt_entry(record, fault, message, stage)]
    limit = get_settings().job_max_attempts
    if record.attempt >= limit:
        log.warning("job %s: attempt %d of %d ended by %s; no attempts left", record.job_id,
                    record.attempt, limit, fault)
        result = finish(store, record, JobStatus.FAILED, critical_error=critical_for(fault, stage or record.stage),
                        error=ErrorInfo(type=fault, message=message[:2000]),
                        fields={"stage": stage or record.stage, "attempts": faults},
                        expect_attempt=record.attempt, handler=handler)
        return result.model_dump(mode="json") if result else None
    ok, _ = store.transition(record.job_id, JobStatus.QUEUED, expect={"attempt": record.attempt},
                             stage_state=StageState.NONE, sandbox=None,
                             state={}, attempts={}, faults=faults, attempt=record.attempt + 1,
                             t_enqueued=time.time(), t_stage_start=0.0)
    if not ok:
        return None
    log.warning("job %s: attempt %d ended by %s (%s); running it again from init", record.job_id,
                record.attempt, fault, message[:200])
    return Requeued(record.job_id, record.data_source)
