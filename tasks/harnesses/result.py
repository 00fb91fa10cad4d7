"""A harness rollout's result fields, in the built-in agent's shape: its calls and conversation
stay in the job's rollout, referenced by ``trajectory`` (the API builds ``messages``, ``tokens``,
``token_mode`` and the harness's segments and counts from it:
:func:`prorl_celery.trajectory.expand_results`), beside ``turns``, ``finish_reason`` and the
harness's own block (how it exited, its session)."""
from __future__ import annotations

from typing import Any

from prorl_celery.trajectory import TRAJECTORY_KEY
from tasks.context import ROLLOUT_KEY


def harness_result_fields(state: dict[str, Any]) -> dict[str, Any]:
    block = state.get("harness") or {}
    saved = state.get(ROLLOUT_KEY) or {}
    return {TRAJECTORY_KEY: {"calls": saved.get("calls", 0), "messages": saved.get("messages", 0)},
            "turns": saved.get("calls", 0), "finish_reason": block.get("finish_reason"),
            "harness": {"name": block.get("name"), "exit_code": block.get("exit_code"),
                        "output": block.get("output", ""), "session": block.get("session")},
            "timing": {"llm": block.get("llm_s", 0.0), "harness": block.get("run_s", 0.0),
                       "gateway": block.get("gateway_s", 0.0)}}
