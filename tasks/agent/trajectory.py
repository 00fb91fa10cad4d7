"""Flatten a rollout's turns into what a policy-gradient step consumes.

``prompt_ids`` is the first turn's prompt; ``response_ids`` is everything after it: each turn's
generated ids (loss mask 1, with their logprobs) and, between turns, the ids the next prompt added
(tool observations and template glue: mask 0, logprob 0.0).

``token_mode`` says how trustworthy the ids are:
- ``exact``: every turn's prompt extends the previous prompt and response id for id (token mode
  always; chat mode when the server reports ids and its template keeps history intact);
- ``retokenized``: the server re-rendered the history differently; the sequence is the last
  prompt plus its response, with earlier responses located in it where they still appear;
- ``none``: the server reported no token ids.
"""
from __future__ import annotations

from typing import Any

from prorl_celery.llm.models import Turn


def _has_ids(turn: Turn) -> bool:
    return turn.prompt_ids is not None and turn.response_ids is not None


def _logprobs(turn: Turn) -> list[float]:
    ids = turn.response_ids or []
    return list(turn.logprobs) if turn.logprobs and len(turn.logprobs) == len(ids) else [0.0] * len(ids)


def flatten(turns: list[Turn]) -> tuple[dict[str, list], str]:
    empty = {"prompt_ids": [], "response_ids": [], "loss_mask": [], "logprobs": []}
    if not turns or not all(_has_ids(t) for t in turns):
        return empty, "none"
    exact = _exact(turns)
    return (exact, "exact") if exact is not None else (_retokenized(turns), "retokenized")


def _exact(turns: list[Turn]) -> dict[str, list] | None:
    prompt = list(turns[0].prompt_ids)
    response, mask, logprobs = [], [], []
    context = list(prompt)
    for i, turn in enumerate(turns):
        if i:
            if turn.prompt_ids[: len(context)] != context:
                return None
            added = turn.prompt_ids[len(context):]
            response += added
            mask += [0] * len(added)
            logprobs += [0.0] * len(added)
        response += turn.response_ids
        mask += [1] * len(turn.response_ids)
        logprobs += _logprobs(turn)
        context = list(turn.prompt_ids) + list(turn.response_ids)
    return {"prompt_ids": prompt, "response_ids": response, "loss_mask": mask, "logprobs": logprobs}


def _find(seq: list[int], part: list[int], start: int) -> int:
    n = len(part)
    for i in range(start, len(seq) - n + 1):
        if seq[i:i + n] == part:
            return i
    return -1


def _retokenized(turns: list[Turn]) -> dict[str, list]:
    first, last = turns[0], turns[-1]
    cut = len(first.prompt_ids) if last.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids else 0
    prompt = list(last.prompt_ids[:cut])
    response = list(last.prompt_ids[cut:]) + list(last.response_ids)
    mask, logprobs = [0] * len(response), [0.0] * len(response)
    position = 0
    for turn in turns:
        at = _find(response, list(turn.response_ids), position) if turn.response_ids else -1
        if at < 0:
            continue
        span = range(at, at + len(turn.response_ids))
        for k, lp in zip(span, _logprobs(turn)):
            mask[k], logprobs[k] = 1, lp
        position = span.stop
    return {"prompt_ids": prompt, "response_ids": response, "loss_mask": mask, "logprobs": logprobs}


def assistant_messages(messages: list[dict[str, Any]], turns: list[Turn]) -> list[dict[str, Any]]:
    """The conversation with each assistant message annotated by the turn that produced it."""
    out, k = [], 0
    for message in messages:
        if message.get("role") == "assistant" and k < len(turns):
            turn = turns[k]
            k += 1
            message = {**message, "backend_id": turn.backend_id, "weight_version": turn.weight_version,
                       "model": turn.model, "token_ids": turn.response_ids, "logprobs": turn.logprobs,
                       "finish_reason": turn.finish_reason}
        out.append(message)
    return out


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
    its numbering. Without ``turns`` (a handler with its own loop) the ids already on the messages stay."""
    annotated = assistant_messages(messages, turns or [])
    out, k = [], 0
    for message in annotated:
        role = message.get("role")
        if role == "assistant":
            turn = turns[k] if turns and k < len(turns) else None
            k += 1
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
