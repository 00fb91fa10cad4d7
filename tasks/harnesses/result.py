"""A harness rollout's result fields, in the built-in agent's shape (``messages``, ``tokens``,
``token_mode``, ``turns``, ``finish_reason``) plus the harness's own block (its segments, the
counts of masked and retokenised ids, how it exited)."""
from __future__ import annotations

from typing import Any

from prorl_celery.gateway.models import CallRecord
from prorl_celery.gateway.trajectory import summary


def harness_result_fields(state: dict[str, Any]) -> dict[str, Any]:
    block = state.get("harness") or {}
    records = [CallRecord.model_validate(r) for r in block.get("calls", [])]
    view = summary(records)
    messages = [{"role": "assistant", "call": r.index, "backend_id": r.backend_id, "weight_version": r.weight_version,
                 "model": r.model, "token_ids": r.response_ids, "logprobs": r.logprobs,
                 "finish_reason": r.finish_reason, "tool_calls": r.tool_calls} for r in records]
    llm_s = sum(r.latency_s for r in records)
    return {"messages": messages, "tokens": view["tokens"], "token_mode": view["token_mode"], "turns": len(records),
            "finish_reason": block.get("finish_reason"),
            "harness": {"name": block.get("name"), "exit_code": block.get("exit_code"),
                        "output": block.get("output", ""), "counts": view["counts"], "segments": view["segments"],
                        "session": block.get("session")},
            "timing": {"llm": round(llm_s, 3), "harness": block.get("run_s", 0.0),
                       "gateway": round(sum(r.gateway_s for r in records), 4)}}
