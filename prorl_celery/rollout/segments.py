"""Trajectories a trainer can use, from a session's calls as the rollout store holds them
(:class:`prorl_celery.rollout.store.Call`, in order; each prompt rebuilt by
:func:`prorl_celery.rollout.store.prompts`):

- per call: one trace each (the call's exact prompt ids, its response ids and logprobs);
- merged: calls chained by token prefix into one sequence per segment. A call whose prompt
  extends the running sequence (the last call's prompt + response) id for id adds the ids in
  between with loss mask 0 (tool results, template glue) and its own response with mask 1; a call
  that does not (context compaction, a sub-agent, a re-rendered history) starts a new segment,
  reported with the reason. Mask-0 ids are counted: they are the ids the gateway cannot prove
  were sampled.

Calls the staleness fence masked (``fenced``: their indices, the result's
``staleness.masked_turns``, as for the built-in agent) keep their ids with loss mask 0, counted
apart (``stale_masked_tokens``).

:func:`harness_fields` is what :func:`prorl_celery.rollout.views.expand_results` adds to a harness's
result: ``tokens`` and ``token_mode`` (``exact`` as for the built-in agent: one sequence, each
prompt extending the last; else ``segmented``, ``tokens`` the first segment), the segments and
the counts (``retokenized_calls``: calls whose prompt rendered an earlier generated turn from text,
its ids not reused, as a harness that changes what it resends makes the gateway do)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prorl_celery.rollout import store
from prorl_celery.rollout.calllog import GATEWAY_META
from prorl_celery.rollout.store import Call
from prorl_celery.rollout.trajectory import served


def prompts(calls: Sequence[Call]) -> list[list[int]]:
    """Each call's whole prompt ids (a gateway call always has them)."""
    return [p or [] for p in store.prompts(calls)]


def continued(call: Call) -> bool:
    """Whether the call's prompt was built by appending to ids the session held (not re-rendered)."""
    return bool((call.meta.get(GATEWAY_META) or {}).get("continued"))


def retokenized(call: Call, k: int) -> bool:
    """Whether call ``k``'s prompt rendered an earlier generated turn from text (its ids not
    reused): the gateway's count of them; a record without it (older), any call after the first
    that was not continued."""
    meta = call.meta.get(GATEWAY_META) or {}
    if "retokenized" in meta:
        return bool(meta["retokenized"])
    return k > 0 and not meta.get("continued")


def _logprobs(call: Call) -> list[float]:
    ids = call.response_ids or []
    return list(call.logprobs) if call.logprobs and len(call.logprobs) == len(ids) else [0.0] * len(ids)


def per_call(calls: Sequence[Call], fenced: Sequence[int] = ()) -> list[dict[str, Any]]:
    out = set(fenced)
    return [{"call": k, "prompt_ids": p, "response_ids": list(c.response_ids or []), "logprobs": _logprobs(c),
             "loss_mask": [0 if k in out else 1] * len(c.response_ids or []),
             "weight_version": c.meta.get("weight_version"), "stale_masked": k in out,
             "backend_id": c.meta.get("backend_id"), "finish_reason": c.meta.get("finish_reason")}
            for k, (c, p) in enumerate(zip(calls, prompts(calls)))]


def merged(calls: Sequence[Call], fenced: Sequence[int] = ()) -> list[dict[str, Any]]:
    """The segments (see the module docstring), each ``{calls, reason, prompt_ids, response_ids,
    loss_mask, logprobs, weight_versions}``; a fenced call's response has loss mask 0."""
    segments: list[dict[str, Any]] = []
    length = 0  # of the running sequence: the last call's prompt + response
    out = set(fenced)
    for k, (call, prompt) in enumerate(zip(calls, prompts(calls))):
        response = list(call.response_ids or [])
        own = 0 if k in out else 1
        if segments and call.keep == length:  # the prompt starts with the whole running sequence
            seg = segments[-1]
            added = prompt[length:]
            seg["calls"].append(k)
            seg["response_ids"] += added + response
            seg["loss_mask"] += [0] * len(added) + [own] * len(response)
            seg["logprobs"] += [0.0] * len(added) + _logprobs(call)
            seg["weight_versions"].append(call.meta.get("weight_version"))
            seg["served"].append(_served(k, call))
        else:
            segments.append({"calls": [k], "reason": "first" if not segments else "not_a_prefix",
                             "prompt_ids": prompt, "response_ids": response, "loss_mask": [own] * len(response),
                             "logprobs": _logprobs(call), "weight_versions": [call.meta.get("weight_version")],
                             "served": [_served(k, call)]})
        length = len(prompt) + len(response)
    return segments


def _served(k: int, call: Call) -> dict[str, Any]:
    """Call ``k``'s replica (backend id and address), prefix-cache hit and routing trace: what the
    trainer's router replay and cache accounting read, one entry per generated span."""
    meta = call.meta
    return {"call": k, "backend_id": meta.get("backend_id"),
            **served(meta.get("address"), meta.get("cached_tokens"), meta.get("routed_experts"))}


def harness_fields(calls: Sequence[Call], fenced: Sequence[int] = ()) -> dict[str, Any]:
    """``tokens``, ``token_mode``, ``segments`` and ``counts`` of a harness's calls (``fenced``:
    the calls the staleness fence masked)."""
    segments = merged(calls, fenced)
    empty: dict[str, list] = {"prompt_ids": [], "response_ids": [], "loss_mask": [], "logprobs": []}
    tokens = {k: segments[0][k] for k in empty} if segments else empty
    mode = "none" if not calls else "exact" if len(segments) == 1 else "segmented"
    counts = {"calls": len(calls), "segments": len(segments),
              "masked_tokens": sum(seg["loss_mask"].count(0) for seg in segments),
              "stale_masked_tokens": sum(len(calls[k].response_ids or []) for k in set(fenced) if k < len(calls)),
              "generated_tokens": sum(len(c.response_ids or []) for c in calls),
              "retokenized_calls": sum(1 for k, c in enumerate(calls) if retokenized(c, k))}
    return {"tokens": tokens, "token_mode": mode, "segments": segments, "counts": counts}
