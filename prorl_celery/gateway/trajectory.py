"""Trajectories a trainer can use, rebuilt from a session's :class:`CallRecord` list.

- per call: one trace each (the call's exact prompt ids, its response ids and logprobs);
- merged: calls chained by token prefix into one sequence per segment. A call whose prompt
  extends the running sequence (the last call's prompt + response) id for id adds the ids in
  between with loss mask 0 (tool results, template glue) and its own response with mask 1; a call
  that does not (context compaction, a sub-agent, a re-rendered history) starts a new segment,
  reported with the reason. Mask-0 ids are counted: they are the ids the gateway cannot prove
  were sampled."""
from __future__ import annotations

from typing import Any

from prorl_celery.gateway.models import CallRecord


def prompts(records: list[CallRecord]) -> list[list[int]]:
    """Each call's whole prompt ids, from the stored base + shared prefix + tail."""
    out: list[list[int]] = []
    for record in records:
        if record.base is None:
            out.append(list(record.prompt_tail))
            continue
        base = records[record.base]
        context = out[record.base] + list(base.response_ids)
        out.append(context[: record.shared] + list(record.prompt_tail))
    return out


def _logprobs(record: CallRecord) -> list[float]:
    n = len(record.response_ids)
    return list(record.logprobs) if record.logprobs and len(record.logprobs) == n else [0.0] * n


def per_call(records: list[CallRecord]) -> list[dict[str, Any]]:
    return [{"call": r.index, "prompt_ids": p, "response_ids": list(r.response_ids), "logprobs": _logprobs(r),
             "loss_mask": [1] * len(r.response_ids), "weight_version": r.weight_version, "backend_id": r.backend_id,
             "finish_reason": r.finish_reason}
            for r, p in zip(records, prompts(records))]


def _segment(first: CallRecord, prompt: list[int], reason: str) -> dict[str, Any]:
    return {"calls": [first.index], "reason": reason, "prompt_ids": list(prompt),
            "response_ids": list(first.response_ids), "loss_mask": [1] * len(first.response_ids),
            "logprobs": _logprobs(first), "weight_versions": [first.weight_version]}


def merged(records: list[CallRecord]) -> list[dict[str, Any]]:
    """The segments (see the module docstring), each ``{calls, reason, prompt_ids, response_ids,
    loss_mask, logprobs, weight_versions}``."""
    segments: list[dict[str, Any]] = []
    context: list[int] = []
    for record, prompt in zip(records, prompts(records)):
        if segments and prompt[: len(context)] == context:
            seg = segments[-1]
            added = prompt[len(context):]
            seg["calls"].append(record.index)
            seg["response_ids"] += added + list(record.response_ids)
            seg["loss_mask"] += [0] * len(added) + [1] * len(record.response_ids)
            seg["logprobs"] += [0.0] * len(added) + _logprobs(record)
            seg["weight_versions"].append(record.weight_version)
        else:
            segments.append(_segment(record, prompt, "first" if not segments else "not_a_prefix"))
        context = prompt + list(record.response_ids)
    return segments


def summary(records: list[CallRecord]) -> dict[str, Any]:
    """The result's view: ``tokens`` (the first segment, as the built-in agent's), ``token_mode``,
    the segments, and the counts a trainer checks."""
    segments = merged(records)
    empty = {"prompt_ids": [], "response_ids": [], "loss_mask": [], "logprobs": []}
    first = segments[0] if segments else None
    tokens = {k: first[k] for k in empty} if first else empty
    if not records:
        mode = "none"
    elif len(segments) == 1 and all(r.continued for r in records[1:]):
        mode = "exact"
    else:
        mode = "segmented"
    masked = sum(seg["loss_mask"].count(0) for seg in segments)
    return {"tokens": tokens, "token_mode": mode, "segments": segments,
            "counts": {"calls": len(records), "segments": len(segments), "masked_tokens": masked,
                       "generated_tokens": sum(len(r.response_ids) for r in records),
                       "retokenized_calls": sum(1 for r in records[1:] if not r.continued)}}
