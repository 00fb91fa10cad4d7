"""The three stage tasks. Each takes only a job id; all state lives in the job store.

A delivery first decides whether it should run at all (the job may have ended, the stage may be
done already, or another delivery may hold the stage's lease), then runs the handler's stage
under a lease, and records what happened. Every way out leaves the job either ready for the next
stage or terminal with a typed result.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import redis
from celery import Task
from celery.exceptions import Ignore

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.celery_app import app
from prorl_celery.connections import get_store
from prorl_celery.errors import JobCancelled, LLMError, ProrlError, SandboxError, StageBudgetExceeded
from prorl_celery.fairshare import FairShare
from prorl_celery.jobs import JobRecord, JobStore
from prorl_celery.leases import Lease
from prorl_celery.llm.pool import end_rollout, end_rollout_on
from prorl_celery.metrics import queue_stage_observation
from prorl_celery.models import ErrorInfo
from prorl_celery.status import JobStatus, StageState
from sandboxes.client import close_handle
from tasks.chain import dispatch
from tasks.context import StageContext
from tasks.handlers import get_handler
from tasks.handlers.base import AgentHandler
from tasks.outcome import finish
from tasks.retry import WORKER_LOST, Requeued, infrastructure_fault, retry_from_init

log = logging.getLogger(__name__)
FALLBACK = AgentHandler()  # the hooks for a job whose handler cannot be loaded: close, no fields
RESULT_REPR_MAX = 96
"""How much of a stage's return Celery's worker writes into its "succeeded" log line and event
(its ``resultrepr_maxsize``, 1,024 by default): the job id and status. Celery builds that text
twice per task, walking the whole result (eval's: 0.24 ms each at 1,024, 0.03 ms at 64); the
result itself is stored whole in the result backend and the job record."""


def stage_budget(record: JobRecord, stage: JobStatus) -> float:
    """The stage's time budget: ``sampling_params["<stage>_budget_s"]`` or the configured default."""
    override = record.sampling_params.get(f"{stage.value}_budget_s")
    return float(override) if override else getattr(get_settings(), f"{stage.value}_budget_s")


def _skip(record: JobRecord, stage: JobStatus, why: str) -> Ignore:
    """The Ignore that ends a delivery which must not run while its job is still active (a
    duplicate, an early or a superseded one): no result is stored for it, so a later delivery
    of the same task id is not mistaken for a done one (``worker_deduplicate_successful_tasks``)."""
    log.info("%s of job %s not run: %s (status %s/%s)", stage, record.job_id, why, record.status,
             record.stage_state or "-")
    return Ignore()


class _JobEnded(Exception):
    """Raised inside a stage whose job ended meanwhile (a cancel); :func:`run_stage` returns
    :func:`_ended`'s note for it."""


def _ended(task: Task, record: JobRecord, stage: JobStatus, why: str) -> dict[str, Any]:
    """End the chain of a delivery whose job has ended, with a note as the task's result.

    Not an Ignore: Celery builds an ``ExceptionInfo`` of every Ignore twice, copying each frame's
    code positions (its own ``trace_task`` is a large function): 1.8 ms of CPU each, measured
    on its tracer, and a bulk cancel ends a thousand stages at once on one run worker while
    their sandboxes die. A stored result cannot mislead here: nothing of an ended job runs again."""
    log.info("%s of job %s ends: %s", stage, record.job_id, why)
    task.request.chain = None  # Celery sends the next link from the request after the return
    return {"job_id": record.job_id, "stage": stage.value, "skipped": why}


def _admit(store: JobStore, task: Task, job_id: str, stage: JobStatus
           ) -> tuple[JobRecord, Lease, bool, float] | dict[str, Any] | None:
    """Read the job, take the stage's lease and mark it running, in one step
    (:meth:`JobStore.admit`); returns the record as it was, the lease, whether the stage
    resumes, and when (monotonic) the change found the job in this stage's attempt. None for an
    unknown job, :func:`_ended`'s note for an ended one; raises Ignore for a delivery that must
    not run."""
    settings = get_settings()
    lease = Lease(store.redis, keys.stage_lease(job_id), settings.stage_lease_s,
                  owner=f"{stage.value}@{task.request.hostname}")
    now = time.time()
    try:  # the lease taken by the change itself
        admission = store.admit(job_id, stage, task.request.hostname or "?", lease.token, lease.ttl_ms,
                                now=now, t_stage_start=now)
    except BaseException:
        lease.release()  # e.g. Redis went away: if the change took the lease, it goes (or lapses)
        raise
    if admission is None:
        log.warning("%s: unknown job %s (expired?); nothing to do", stage, job_id)
        return None
    record = admission.record
    if not admission.admitted:
        if record.status.terminal:  # cancelled before this stage began: end the chain
            return _ended(task, record, stage, "the job has ended")
        why = {"done": "already done (a duplicate delivery)", "early": "the previous stage still runs"}.get(
            admission.why, "the job changed meanwhile")
        if admission.why == "leased":
            why = f"another delivery holds the lease ({store.redis.get(lease.key)!r})"
        raise _skip(record, stage, why)
    confirmed = time.monotonic()
    lease.taken_elsewhere()
    return record, lease, record.status is stage, confirmed


def run_stage(task: Task, stage: JobStatus, job_id: str) -> dict[str, Any] | None:
    store = get_store()
    admitted = _admit(store, task, job_id, stage)
    if not isinstance(admitted, tuple):
        return admitted
    record, lease, resumed, confirmed = admitted
    if record.project:
        _fair_share(store, record.job_id, started=True)
    try:
        limit = get_settings().stage_max_attempts
        if resumed and record.attempts[stage.value] > limit:
            if record.sandbox:
                close_handle(record.sandbox)
            out = retry_from_init(store, record, WORKER_LOST,
                                  f"{stage} was started {limit} times and never finished", stage.value)
        else:
            out = _execute(store, record, stage, resumed, lease, confirmed)
    except _JobEnded as ended:
        return _ended(task, record, stage, str(ended))
    finally:
        lease.release()
    if isinstance(out, Requeued):  # sent only now: the new init must find the lease free
        out.send()
        raise _skip(record, stage, "the job runs again from init")  # ends this chain
    if record.project:
        _fair_share(store, record.job_id, started=False)
    return out


def _fair_share(store: JobStore, job_id: str, started: bool) -> None:
    """Tell fair share (prorl_celery/fairshare.py) that a project's job left a queue (its stage
    began: release more) or finished a stage (it waits for the next, or ended: release more).
    Its failure never fails the stage: the beat's sweep releases too."""
    try:
        if not started and store.status(job_id) in (JobStatus.INIT, JobStatus.RUN):
            FairShare(store.redis).waiting_for_next(job_id)
        else:
            dispatch(store, started=job_id if started else None)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("fair share after %s of job %s: %s", "start" if started else "end", job_id, exc)


def _execute(store: JobStore, record: JobRecord, stage: JobStatus, resumed: bool,
             lease: Lease | None = None, confirmed: float | None = None) -> dict[str, Any] | Requeued | None:
    """The handler's stage and what it left. ``lease``: the delivery's stage lease, released by
    the change that ends a stage (still released by :func:`run_stage` on every other way out).
    ``confirmed``: when (monotonic) the running change found the job in this stage and attempt,
    as a save does: a ``ctx.check()`` right after it (a handler's first step; the sandbox's
    open) then reads no status again."""
    ctx = StageContext(store, record, stage, stage_budget(record, stage), resumed=resumed, confirmed=confirmed)
    handler = FALLBACK  # until the job's own is loaded: its failure is recorded by the base hooks
    try:
        handler = get_handler(record.data_source)  # the one look-up of this stage
        outcome = getattr(handler, stage.value)(ctx)
        ctx.flush()
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a typed result
        record.add_stage_time(stage, time.monotonic() - ctx.started)
        try:
            return _fail(store, record, stage, ctx, handler, exc)
        finally:
            if stage is JobStatus.RUN:  # the rollout's LLM calls are over: its backend's room is free
                end_rollout(store.redis, record.job_id)
    # The run's LLM session ends with the stage's done change, on its pipeline (where the routing
    # lives on the head's Redis; else by a call of its own, first).
    end_session = end_rollout_on(store.redis, record.job_id) if stage is JobStatus.RUN else None
    if stage is JobStatus.RUN and end_session is None:
        end_rollout(store.redis, record.job_id)
    elapsed = record.add_stage_time(stage, time.monotonic() - ctx.started)
    seconds = time.monotonic() - ctx.started
    if stage is JobStatus.EVAL:
        handler.finish(ctx)
        # One round trip: the histogram, the terminal change (which releases the stage lease),
        # the cost into the project's totals.
        result = finish(store, record, JobStatus.COMPLETED, handler=handler, state=ctx.state,
                        fields=outcome or {}, expect_attempt=record.attempt, lease=lease,
                        before=lambda pipe: queue_stage_observation(pipe, stage.value, seconds))
        return result.model_dump(mode="json") if result else _current_result(store, record.job_id)
    # Narrowed to this stage: the status stays, and only while it is still this stage. One round
    # trip: the histogram, the change, and the stage lease released by the change itself.
    ok, status = store.transition(record.job_id, None, sources=[stage], stage_state=StageState.DONE,
                                  expect={"attempt": record.attempt}, lease_token=lease and lease.token,
                                  before=lambda pipe: queue_stage_observation(pipe, stage.value, seconds),
                                  after=end_session, state=ctx.state.dump(), t_enqueued=time.time(), **elapsed)
    if ok and lease is not None:
        lease.released_elsewhere()
    if not ok:
        ctx.close_sandbox()
        return _current_result(store, record.job_id)
    return {"job_id": record.job_id, "status": status.value, "stage_done": stage.value}


def _fail(store: JobStore, record: JobRecord, stage: JobStatus, ctx: StageContext, handler: AgentHandler,
          exc: BaseException) -> dict[str, Any] | Requeued | None:
    if isinstance(exc, redis.RedisError):
        # The job store itself is unreachable: nothing can be recorded now. Leave the sandbox
        # alone; the lease lapses and the sweep sends the stage again, which resumes.
        log.warning("job %s: %s stage lost the job store (%s); it will be resumed", record.job_id, stage, exc)
        raise exc
    if isinstance(exc, Exception) and not isinstance(exc, JobCancelled):
        _flush(ctx)
    try:
        handler.on_exception(ctx, exc)
    except Exception:  # noqa: BLE001 - cleanup must not hide the original failure
        log.exception("on_exception of %s failed", record.data_source)
        ctx.close_sandbox()
    if isinstance(exc, JobCancelled):  # ended by someone else: nothing for the later stages
        raise _JobEnded("the job ended while the stage ran") from None
    if isinstance(exc, StageBudgetExceeded):
        return _end(store, record, handler, JobStatus.TIMEOUT, stage, ctx.state, "timeout", str(exc),
                    critical="timeout")
    if not isinstance(exc, Exception):
        raise exc  # SystemExit / KeyboardInterrupt: let the worker shut down; the lease lapses
    fault = infrastructure_fault(exc)
    if fault is not None:
        out = retry_from_init(store, record, fault, str(exc), stage.value, handler=handler)
        if out is None:  # the job had ended (a cancel kills its sandbox): end the chain here
            raise _JobEnded(f"the job ended meanwhile ({fault})") from None
        return out
    critical = "sandbox" if isinstance(exc, SandboxError) else "llm" if isinstance(exc, LLMError) else stage.value
    etype = exc.type if isinstance(exc, ProrlError) else type(exc).__name__
    log.warning("job %s failed in %s: %s: %s", record.job_id, stage, etype, exc)
    return _end(store, record, handler, JobStatus.FAILED, stage, ctx.state, etype, str(exc), critical=critical)


def _flush(ctx: StageContext) -> None:
    """Store the turns the failed stage had not saved yet, for the failure's partial trajectory."""
    try:
        ctx.flush()
    except (JobCancelled, redis.RedisError) as exc:  # ended meanwhile, or the store went: the saved ones stay
        log.info("job %s: the last turns were not saved (%s)", ctx.job_id, exc)


def _end(store: JobStore, record: JobRecord, handler: AgentHandler, status: JobStatus, stage: JobStatus,
         state: dict[str, Any] | None, etype: str, message: str, critical: str | None = None):
    # Narrowed to the stage that failed: the table would let any active status end, but only
    # this stage's own failure may end the job (never a later stage of the same attempt).
    result = finish(store, record, status, handler=handler, state=state, critical_error=critical or stage.value,
                    error=ErrorInfo(type=etype, message=message[:2000]), fields={"stage": stage.value},
                    sources=[stage], expect_attempt=record.attempt)
    return result.model_dump(mode="json") if result else _current_result(store, record.job_id)


def _current_result(store: JobStore, job_id: str) -> dict[str, Any] | None:
    record = store.get(job_id)
    return record.result if record else None


@app.task(name="prorl.init", bind=True, resultrepr_maxsize=RESULT_REPR_MAX)
def init(self: Task, job_id: str, data_source: str | None = None) -> dict[str, Any] | None:
    """Init stage: open the sandbox and prepare the task."""
    return run_stage(self, JobStatus.INIT, job_id)


@app.task(name="prorl.run", bind=True, resultrepr_maxsize=RESULT_REPR_MAX)
def run(self: Task, job_id: str, data_source: str | None = None) -> dict[str, Any] | None:
    """Run stage: the rollout itself."""
    return run_stage(self, JobStatus.RUN, job_id)


@app.task(name="prorl.eval", bind=True, resultrepr_maxsize=RESULT_REPR_MAX)
def eval_(self: Task, job_id: str, data_source: str | None = None) -> dict[str, Any] | None:
    """Eval stage: score the rollout and record the final result."""
    return run_stage(self, JobStatus.EVAL, job_id)


STAGE_TASKS = {JobStatus.INIT: init, JobStatus.RUN: run, JobStatus.EVAL: eval_}
