"""Flatten a rollout's turns (or its stored calls) into what a policy-gradient step consumes.

``prompt_ids`` is the first turn's prompt; ``response_ids`` is everything after it: each turn's
generated ids (loss mask 1, with their logprobs) and, between turns, the ids the next prompt added
(tool observations and template glue: mask 0, logprob 0.0).

Every generated id knows the weight version that sampled it (:func:`token_versions`, from each
turn's ``weight_segments``: a turn that spanned a weight update has one segment per version), and
turns fenced for staleness get loss mask 0 (:func:`mask_turns`).

``token_mode`` says how trustworthy the ids are:
- ``exact``: every turn's prompt extends the previous prompt and response id for id (token mode
  always; chat mode when the server reports ids and its template keeps history intact);
- ``retokenized``: the server re-rendered the history differently; the sequence is the last
  prompt plus its response, with earlier responses located in it where they still appear;
- ``none``: the server reported no token ids.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prorl_celery.llm.models import Turn
from prorl_celery.rollout.store import Call, is_exact
from prorl_celery.rollout.transcript import generated_by, turns_of


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
    """The conversation with each message a turn generated annotated by that turn, found by the
    message's provenance tag (:func:`prorl_celery.rollout.transcript.generated_by`), never by its
    position: one a harness wrote (``resent``) or any other untagged one gets no ids."""
    out = []
    for message in messages:
        k = generated_by(message)
        if k is not None and k < len(turns):
            turn = turns[k]
            message = {**message, "backend_id": turn.backend_id, "weight_version": turn.weight_version,
                       "model": turn.model, "token_ids": turn.response_ids, "logprobs": turn.logprobs,
                       "finish_reason": turn.finish_reason}
            if turn.weight_segments is not None:  # which of token_ids each version sampled
                message["weight_segments"] = [seg.model_dump() for seg in turn.weight_segments]
            message.update(served(turn.address, turn.cached_tokens, turn.routed_experts))
        out.append(message)
    return out


def served(address: str | None, cached_tokens: int | None, routed_experts: Any) -> dict[str, Any]:
    """How a generated span was served: the replica's address, and its prefix-cache hit and MoE
    routing trace where the server reported them (absent where it did not)."""
    out: dict[str, Any] = {"address": address}
    if cached_tokens is not None:
        out["cached_tokens"] = cached_tokens
    if routed_experts is not None:
        out["routed_experts"] = routed_experts
    return out


def flatten_calls(calls: Sequence[Call]) -> tuple[dict[str, list], str]:
    """:func:`flatten` of stored calls; an exact rollout in one pass over what each call added."""
    if not is_exact(calls):
        return flatten(turns_of(calls)) if calls else flatten([])
    prompt, response, mask, logprobs = list(calls[0].new_ids), [], [], []
    for k, call in enumerate(calls):
        if k:
            response += call.new_ids
            mask += [0] * len(call.new_ids)
            logprobs += [0.0] * len(call.new_ids)
        n = len(call.response_ids)
        response += call.response_ids
        mask += [1] * n
        logprobs += list(call.logprobs) if call.logprobs and len(call.logprobs) == n else [0.0] * n
    return {"prompt_ids": prompt, "response_ids": response, "loss_mask": mask, "logprobs": logprobs}, "exact"


def call_versions(call: Call) -> list[str | None]:
    """The weight version of each of a stored call's response ids: its segments where the turn
    recorded them (a turn spanning an update has several), else its one ``weight_version``."""
    n = len(call.response_ids or [])
    out: list[str | None] = [call.meta.get("weight_version")] * n
    for seg in call.meta.get("weight_segments") or []:
        for k in range(max(0, seg["start"]), min(n, seg["end"])):
            out[k] = seg["version"]
    return out


def token_versions(calls: Sequence[Call], tokens: dict[str, list], mode: str) -> list[str | None] | None:
    """One entry per id of ``tokens["response_ids"]`` (an exact rollout): the version that sampled
    it, None for ids the prompts added (observations, template glue). None when not exact."""
    if mode != "exact":
        return None
    out: list[str | None] = []
    for k, call in enumerate(calls):
        if k:
            out += [None] * len(call.new_ids or [])
        out += call_versions(call)
    return out if len(out) == len(tokens["response_ids"]) else None


def mask_turns(calls: Sequence[Call], tokens: dict[str, list], mode: str, turns: Sequence[int]) -> int:
    """Loss mask 0 on the generated ids of ``turns`` (indices of calls) fenced for staleness, in
    an exact rollout; returns how many ids were masked."""
    if mode != "exact" or not turns:
        return 0
    fenced, at, masked = set(turns), 0, 0
    for k, call in enumerate(calls):
        if k:
            at += len(call.new_ids or [])
        n = len(call.response_ids or [])
        if k in fenced:
            for i in range(at, at + n):
                masked += tokens["loss_mask"][i]
                tokens["loss_mask"][i] = 0
        at += n
    return masked
