"""A harness rollout's result fields, in the built-in agent's shape: its calls and conversation
stay in the job's rollout, referenced by ``trajectory`` (the API builds ``messages``, ``tokens``,
``token_mode`` and the harness's segments and counts from it:
:func:`prorl_celery.trajectory.expand_results`), beside ``turns``, ``finish_reason`` and the
harness's own block (how it exited, its session)."""
from __future__ import annotations

from typing import Any

from prorl_celery.trajectory import TRAJECTORY_KEY
from tasks.agent.fence import result_block
from tasks.context import ADMISSION_KEY, ROLLOUT_KEY

RESTARTS_KEY = "harness_restarts"  # in a job's state: how often its harness ran again (tasks.harnesses.run)
# in a job's sampling_params: true makes a result filtered (filter: true) when its harness sent
# any sampling field the gateway dropped (harness.sampling.dropped): its calls were not sampled
# as the harness asked, and a trainer that wants only such samples refuses the rest
STRICT_SAMPLING = "strict_sampling"


def harness_result_fields(state: dict[str, Any]) -> dict[str, Any]:
    block = state.get("harness") or {}
    saved = state.get(ROLLOUT_KEY) or {}
    out = {TRAJECTORY_KEY: {"calls": saved.get("calls", 0), "messages": saved.get("messages", 0)},
           "turns": saved.get("calls", 0), "finish_reason": block.get("finish_reason"),
           "harness": {"name": block.get("name"), "exit_code": block.get("exit_code"),
                       "output": block.get("output", ""), "session": block.get("session"),
                       "route": block.get("route"), "restarts": state.get(RESTARTS_KEY, 0),
                       "sampling": block.get("sampling")},
           "timing": {"llm": block.get("llm_s", 0.0), "harness": block.get("run_s", 0.0),
                      "gateway": block.get("gateway_s", 0.0)}}
    staleness = staleness_fields(block, state.get(ADMISSION_KEY))
    if staleness:
        out["staleness"] = staleness
    sampling = block.get("sampling") or {}
    if sampling.get("strict") and sampling.get("dropped"):  # the trainer refuses it (STRICT_SAMPLING)
        out["filter"] = True
    return out


def staleness_fields(block: dict[str, Any], admission: dict[str, Any] | None) -> dict[str, Any] | None:
    """The result's ``staleness`` as the built-in agent's (:func:`tasks.handlers.agentic.staleness_fields`):
    the bound, the fence, the calls masked (indices: ``masked_turns``), the calls regenerated and
    their tokens, the largest lag, and the admission wait; None without a bound."""
    return result_block(block.get("staleness"), admission)
