"""The conversation in the reference system's shape (NeMo Gym's ``prorl_agent`` reads it).

The flattening of turns into ids lives in :mod:`prorl_celery.rollout.trajectory`.
"""
from __future__ import annotations

from typing import Any

from prorl_celery.llm.models import Turn
from prorl_celery.rollout.trajectory import assistant_messages
from prorl_celery.rollout.transcript import generated_by


def flat_tool_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI's nested ``{"id", "type", "function": {"name", "arguments"}}`` as the reference
    system's flat ``{"name", "arguments"}`` (the ``id`` kept: NeMo Gym reads only the other two)."""
    out = []
    for call in calls or []:
        function = call.get("function") if isinstance(call.get("function"), dict) else call
        flat = {"name": function.get("name", ""), "arguments": function.get("arguments", "")}
        if call.get("id"):
            flat["id"] = call["id"]
        out.append(flat)
    return out


def reference_messages(messages: list[dict[str, Any]], turns: list[Turn] | None) -> list[dict[str, Any]]:
    """The conversation in the reference system's shape, which NeMo Gym's ``prorl_agent`` reads:
    each assistant message with the ids of the turn that produced it (``input_ids``: the exact
    prompt ids it was generated from; ``token_ids``: the generated ids; ``logprobs``) and flat
    ``tool_calls``. Tool messages lose ``tool_call_id``: Gym numbers the calls itself and pairs each
    result with the oldest unanswered call, which is our order, while an id of ours would not match
    its numbering. The ids are the call's whose answer the message is stored as (its provenance tag);
    an assistant message no call generated (a harness's own, ``resent``) gets None. Without
    ``turns`` (a handler with its own loop) the ids already on the messages stay."""
    annotated = assistant_messages(messages, turns or [])
    out = []
    for message in annotated:
        role = message.get("role")
        if role == "assistant":
            k = generated_by(message)  # the call that generated it, by its stored tag (a resent one: none)
            turn = turns[k] if turns and k is not None and k < len(turns) else None
            message = {**message, "tool_calls": flat_tool_calls(message.get("tool_calls"))}
            if turn is not None:
                message["input_ids"] = turn.prompt_ids
            message.setdefault("input_ids", None)
            message.setdefault("token_ids", None)
            message.setdefault("logprobs", None)
        elif role == "tool":
            message = {key: value for key, value in message.items() if key != "tool_call_id"}
        out.append(message)
    return out
