"""A harness rollout's result fields, in the built-in agent's shape: its calls and conversation
stay in the job's rollout, referenced by ``trajectory`` (the API builds ``messages``, ``tokens``,
``token_mode`` and the harness's segments and counts from it:
:func:`prorl_celery.rollout.trajectory.expand_results`), beside ``turns``, ``finish_reason`` and the
harness's own block (how it exited, its session)."""
from __future__ import annotations

from typing import Any

from prorl_celery.jobstate import ADMISSION_KEY, RESTARTS_KEY, Admission, JobState, RolloutCounts
from prorl_celery.rollout.trajectory import TRAJECTORY_KEY


def harness_result_fields(state: dict[str, Any]) -> dict[str, Any]:
    block = state.get("harness") or {}
    saved = (JobState.of(state).rollout or RolloutCounts()).model_dump()
    out = {TRAJECTORY_KEY: {"calls": saved.get("calls", 0), "messages": saved.get("messages", 0)},
           "turns": saved.get("calls", 0), "finish_reason": block.get("finish_reason"),
           "harness": {"name": block.get("name"), "exit_code": block.get("exit_code"),
                       "output": block.get("output", ""), "session": block.get("session"),
                       "route": block.get("route"), "restarts": state.get(RESTARTS_KEY, 0)},
           "timing": {"llm": block.get("llm_s", 0.0), "harness": block.get("run_s", 0.0),
                      "gateway": block.get("gateway_s", 0.0)}}
    staleness = staleness_fields(block, state.get(ADMISSION_KEY))
    if staleness:
        out["staleness"] = staleness
    return out


def staleness_fields(block: dict[str, Any], admission: dict[str, Any] | None) -> dict[str, Any] | None:
    """The result's ``staleness`` as the built-in agent's (:func:`tasks.handlers.agentic.staleness_fields`):
    the bound, the fence, the calls masked (indices: ``masked_turns``), the calls regenerated and
    their tokens, the largest lag, and the admission wait; None without a bound."""
    return result_block(block.get("staleness"), admission)


def result_block(fenced: dict[str, Any] | None, admission: Any) -> dict[str, Any] | None:
    """A result's ``staleness``, for the built-in agent and harness sessions alike: the fence's
    counts (the bound, the mode, what it masked and regenerated, the largest lag kept) with the
    admission wait; None without a bound."""
    out = dict(fenced or {})
    if not out and not admission:
        return None
    out.pop("turn_versions", None)
    if admission:  # a JobState's Admission, or its stored form
        admission = Admission.model_validate(admission)
        out["admission_wait_s"], out["admitted_version"] = admission.wait_s, admission.version
    return out
