"""Ending a job: the one place that builds the typed result and makes the job terminal."""
from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from prorl_celery.errors import UnknownPlugin
from prorl_celery.jobs import JobRecord, JobStore
from prorl_celery.jobstate import ROLLOUT_KEY, SANDBOX_KEY, USAGE_KEY
from prorl_celery.models import ErrorInfo, JobResult
from prorl_celery.leases import Lease
from prorl_celery.rollout.cost import (END_TOKEN, ENDED, Cost, add_totals, cost_of,
                                         ended_totals_args, queue_ended_totals, read_heads)
from prorl_celery.staleness import WeightVersions
from prorl_celery.status import JobStatus

if TYPE_CHECKING:
    from tasks.handlers.base import AgentHandler

log = logging.getLogger(__name__)


def build_result(record: JobRecord, status: JobStatus, *, handler: AgentHandler | None = None,
                 state: dict[str, Any] | None = None, critical_error: str | None = None,
                 error: ErrorInfo | None = None, fields: dict[str, Any] | None = None,
                 now: float | None = None) -> JobResult:
    """The job's typed result: the handler's ``result_fields`` of the state, then ``fields``.
    A stage passes the ``handler`` it runs; without one (a cancel, the sweep) it is looked up."""
    state = record.state if state is None else state
    partial = (_handler_of(record) if handler is None else handler).result_fields(state)
    record.t_finished = now or time.time()
    instance = record.instance
    data = {**partial, **(fields or {})}
    data.setdefault("filter", status is not JobStatus.COMPLETED)
    if state.get(SANDBOX_KEY):  # which runtime and isolation the job really ran in
        data.setdefault("sandbox", state[SANDBOX_KEY])
    if "attempts" not in data:
        last = None if status is JobStatus.COMPLETED else (error.type if error else status.value)
        entry = {"attempt": record.attempt, "stage": data.get("stage") or record.stage, "fault": last,
                 "message": error.message[:500] if error and last else "",
                 "host": (record.sandbox or {}).get("host_id")}
        data["attempts"] = [*record.faults, entry]
    timing = record.timings().model_copy(update=data.pop("timing", {}))
    return JobResult(job_id=record.job_id, status=status, critical_error=critical_error, error=error,
                     timing=timing, instance_id=_maybe_str(instance.get("instance_id")),
                     trajectory_id=_maybe_int(instance.get("trajectory_id")), **data)


def finish(store: JobStore, record: JobRecord, status: JobStatus, *, sources: list[JobStatus] | None = None,
           expect_attempt: int | None = None, lease: Lease | None = None,
           before: Callable[[Any], None] | None = None, **kwargs: Any) -> JobResult | None:
    """Make the job terminal with its result. Returns None if it had already ended, or (with
    ``sources``, which narrow the transition table's, / ``expect_attempt``) is no longer in one
    of those statuses or that attempt.

    One round trip (past the cost's read, none for a job that saved no calls): ``before``'s
    commands (the eval stage's histogram), the terminal transition, which also releases
    ``lease`` (the delivery's stage lease) if it holds it still, and the cost into the project's
    totals, added only if this transition ended the job (the token it wrote: exactly once)."""
    result = build_result(record, status, **kwargs)
    (cost,) = _with_cost(store, [(record, kwargs.get("state"))], [result])
    expect = {"attempt": expect_attempt} if expect_attempt is not None else None
    fields = _terminal_fields(store, record, result, kwargs.get("state"))
    after = None
    if cost is not None:
        token = uuid.uuid4().hex
        fields[END_TOKEN] = token

        def after(pipe: Any, again: bool) -> None:
            if again:  # Redis lacked a script: this one whole
                ENDED.whole(pipe, *ended_totals_args(record.job_id, token, record.project, cost))
            else:
                queue_ended_totals(pipe, record.job_id, token, record.project, cost)

    ok, current = store.transition(record.job_id, status, sources=sources, expect=expect,
                                   lease_token=lease.token if lease is not None else None,
                                   before=before, after=after, **fields)
    if not ok:
        log.info("job %s already ended as %s; %s not recorded", record.job_id, current, status)
        return None
    if lease is not None:
        lease.released_elsewhere()
    _nothing_to_consume(store, [(record, result)])
    return result


def finish_many(store: JobStore, ends: list[tuple[JobRecord, dict[str, Any]]],
                status: JobStatus) -> list[JobResult | None]:
    """:func:`finish` (without ``sources`` or ``expect_attempt``) of many jobs in one store round
    trip, each ``(record, build_result keyword arguments)``; None for a job that had ended."""
    results = [build_result(record, status, **kwargs) for record, kwargs in ends]
    costs = _with_cost(store, [(record, kwargs.get("state")) for record, kwargs in ends], results)
    done = store.transition_many((record.job_id, status, _terminal_fields(store, record, result, kwargs.get("state")))
                                 for (record, kwargs), result in zip(ends, results))
    out = [result if ok else None for result, (ok, _) in zip(results, done)]
    _nothing_to_consume(store, [(record, r) for (record, _), r in zip(ends, out) if r is not None])
    add_totals(store.redis, [(record.project, cost) for (record, _), cost, r in zip(ends, costs, out)
                             if r is not None and cost is not None])
    return out


def _with_cost(store: JobStore, jobs: list[tuple[JobRecord, Any]], results: list[JobResult]) -> list[Cost | None]:
    """Each result's ``cost`` (:mod:`prorl_celery.rollout.cost`), from its rollout's saved calls.
    Never in the way of ending the job: a cost that cannot be read is left out (and logged)."""
    try:
        counts = [_saved_calls(state if state is not None else record.state) for record, state in jobs]
        blobs = read_heads(store.shards, [(record.job_id, n) for (record, _), n in zip(jobs, counts)])
        costs = [cost_of(calls, result.timing, _usage(state if state is not None else record.state))
                 for calls, result, (record, state) in zip(blobs, results, jobs)]
    except Exception:  # noqa: BLE001 - a job's end must not depend on its bill
        log.warning("could not read the cost of %d jobs", len(jobs), exc_info=True)
        return [None] * len(jobs)
    for result, cost in zip(results, costs):
        result.cost = cost.model_dump(mode="json")
    return costs


def _usage(state: Any) -> dict[str, Any] | None:
    """What the job's closed sandboxes used (:meth:`tasks.context.StageContext.close_sandbox`)."""
    return state.get(USAGE_KEY) if state is not None else None


def _saved_calls(state: Any) -> int:
    """The calls its last save stored (a JobState's or its stored dict's). A state without the
    counts saved none: every save within a job writes them with its calls (the fenced save), and
    the result's trajectory (:func:`prorl_celery.rollout.results.trajectory_fields`) reads none
    then; records past the counts are writes that lost the job. No counts, no read."""
    saved = state.get(ROLLOUT_KEY) if state is not None else None
    if saved is None:
        return 0
    return (saved.get("calls") if isinstance(saved, dict) else getattr(saved, "calls", None)) or 0


def _nothing_to_consume(store: JobStore, ended: list[tuple[JobRecord, JobResult]]) -> None:
    """A job that ended without a result to train on no longer holds back admission (the
    staleness bound, of its own project's versions, waits only for results the trainer will consume)."""
    by_project: dict[str | None, list[str]] = {}
    for record, result in ended:
        if result.status is not JobStatus.COMPLETED:
            by_project.setdefault(record.project, []).append(result.job_id)
    for project, ids in by_project.items():
        WeightVersions(store.redis, project).consume(ids)


def _terminal_fields(store: JobStore, record: JobRecord, result: JobResult, state: Any) -> dict[str, Any]:
    fields = {"result": result.model_dump(mode="json"), "t_finished": record.t_finished, **record.stage_times()}
    if store.shards.sharded:  # the last stage saved its state on the shard only: the head keeps the final one
        fields["state"] = record.state if state is None else state.dump() if hasattr(state, "dump") else state
    return fields


def _handler_of(record: JobRecord) -> AgentHandler:
    """The job's handler; the base one (no partial fields) if its data source names none now."""
    from tasks.handlers import get_handler
    from tasks.handlers.base import AgentHandler

    try:
        return get_handler(record.data_source)
    except UnknownPlugin:
        return AgentHandler()


def _maybe_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _maybe_int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
