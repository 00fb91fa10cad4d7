"""A rollout's result fields, for both agent kinds, from the job's state (:class:`JobState`).

The calls and the conversation stay in the job's rollout, referenced by ``trajectory`` (the
calls and messages saved); the views build ``messages``, ``tokens``, ``token_mode`` (and a
harness's segments and counts) from it when the result is read
(:func:`prorl_celery.rollout.views.expand_results`). Beside it: ``turns``, ``finish_reason``,
``timing``, ``staleness``, and each kind's own: the built-in agent's ``answer``, a harness's
``harness`` block (which one, how it exited, its session and route, its restarts).

To add a field a trainer gets from a rollout: its block in the state is written by its runner
(``tasks/agent/runner.py``, ``tasks/harnesses/run.py``), read here, typed in
:class:`prorl_celery.models.JobResult`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prorl_celery.jobstate import HARNESS_KEY, Admission, JobState, RolloutCounts

TRAJECTORY_KEY = "trajectory"  # in a stored result: {"calls", "messages"} saved of the job's rollout
# in a job's sampling_params: true makes a result filtered (filter: true) when its harness sent
# any sampling field the gateway dropped (harness.sampling.dropped): its calls were not sampled
# as the harness asked, and a trainer that wants only such samples refuses the rest
STRICT_SAMPLING = "strict_sampling"


def trajectory_fields(state: JobState) -> dict[str, Any]:
    """The reference to the rollout as saved, and its ``turns`` (one per call)."""
    saved = state.rollout or RolloutCounts()
    return {TRAJECTORY_KEY: {"calls": saved.calls, "messages": saved.messages}, "turns": saved.calls}


def staleness_block(fenced: dict[str, Any] | None, admission: Admission | dict[str, Any] | None
                    ) -> dict[str, Any] | None:
    """A result's ``staleness``, for the built-in agent and harness sessions alike: the fence's
    counts (the bound, the mode, the turns or calls masked (indices: ``masked_turns``), those
    regenerated and their tokens, the largest lag kept) with the admission wait; None without a
    bound."""
    out = dict(fenced or {})
    if not out and not admission:
        return None
    out.pop("turn_versions", None)
    if admission:
        admission = Admission.model_validate(admission)
        out["admission_wait_s"], out["admitted_version"] = admission.wait_s, admission.version
    return out


def _with_staleness(out: dict[str, Any], block: dict[str, Any], state: JobState) -> dict[str, Any]:
    staleness = staleness_block(block.get("staleness"), state.admission)
    if staleness:
        out["staleness"] = staleness
    return out


def agent_result_fields(state: JobState | Mapping[str, Any]) -> dict[str, Any]:
    """The built-in agent's: its episode's (``state.agent``, :class:`tasks.agent.episode.Episode`)."""
    state = JobState.of(state)
    agent = state.agent or {}
    out = {**trajectory_fields(state), "finish_reason": agent.get("finish_reason"), "answer": agent.get("answer"),
           "timing": {"llm": agent.get("llm_s", 0.0), "actions": agent.get("actions_s", 0.0)}}
    return _with_staleness(out, agent, state)


def harness_result_fields(state: JobState | Mapping[str, Any]) -> dict[str, Any]:
    """A harness's: its block (``state.harness``, :mod:`tasks.harnesses.run`), in the built-in
    agent's shape where the two share a field."""
    state = JobState.of(state)
    block = state.harness or {}
    out = {**trajectory_fields(state), "finish_reason": block.get("finish_reason"),
           HARNESS_KEY: {"name": block.get("name"), "exit_code": block.get("exit_code"),
                         "output": block.get("output", ""), "session": block.get("session"),
                         "route": block.get("route"), "restarts": state.harness_restarts or 0,
                         "sampling": block.get("sampling"),
                         **({"tools": block["tools"]} if block.get("tools") else {})},
           "timing": {"llm": block.get("llm_s", 0.0), "harness": block.get("run_s", 0.0),
                      "gateway": block.get("gateway_s", 0.0)}}
    sampling = block.get("sampling") or {}
    if sampling.get("strict") and sampling.get("dropped"):  # the trainer refuses it (STRICT_SAMPLING)
        out["filter"] = True
    return _with_staleness(out, block, state)


def is_harness_result(result: Mapping[str, Any]) -> bool:
    """Whether a stored result is a harness's (it has the ``harness`` block
    :func:`harness_result_fields` gives it): its view adds the segments."""
    return isinstance(result.get(HARNESS_KEY), dict)
