"""A job as the trainer reads it: its stored result's ``trajectory`` reference built, at read
time, from the job's rollout.

A stored result keeps a reference (:data:`~prorl_celery.rollout.results.TRAJECTORY_KEY`: the
calls and messages saved), never a copy; reading it replaces the reference by ``messages`` (each
assistant message with its turn's ids and logprobs), ``tokens`` and ``token_mode``, and by each
kind's own: the built-in agent's ``token_versions`` (:mod:`prorl_celery.rollout.trajectory`), a
harness's segments and counts in its ``harness`` block (:mod:`prorl_celery.rollout.segments`).
Turns or calls the staleness fence masked keep their ids at loss mask 0, their assistant messages
marked ``stale_masked``. Every rollout a read needs comes in one round trip.

The job store (:mod:`prorl_celery.jobs`) knows none of this: the API and the completion stream
ask :func:`job_views` for what they show.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis

from prorl_celery.jobs import JobRecord
from prorl_celery.jobstate import HARNESS_KEY
from prorl_celery.models import JobView
from prorl_celery.rollout.results import TRAJECTORY_KEY, is_harness_result
from prorl_celery.rollout.segments import harness_fields
from prorl_celery.rollout.store import Call, RolloutStore
from prorl_celery.rollout.trajectory import assistant_messages, flatten_calls, mask_turns, token_versions
from prorl_celery.rollout.transcript import generated_by, turns_of
from prorl_celery.shards import Shards


def job_views(client: redis.Redis | Shards, records: Sequence[JobRecord | None]) -> list[JobView | None]:
    """Each record as the API shows it, its result's trajectory built from the job's rollout
    (all of them in one more round trip)."""
    results = expand_results(client, [r.result if r else None for r in records])
    return [r.view(result) if r else None for r, result in zip(records, results)]


def expand_results(client: redis.Redis | Shards, results: Sequence[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
    """Stored results as the trainer reads them, their rollouts read in one round trip (see the
    module). A result without a reference is returned as it is."""
    refs = [(i, r) for i, r in enumerate(results) if r and isinstance(r.get(TRAJECTORY_KEY), dict)]
    if not refs:
        return list(results)
    shards = Shards.of(client)
    out = list(results)
    for store, positions in shards.by_store(r["job_id"] for _, r in refs):  # one round trip per shard
        pipe = store.pipeline(transaction=False)
        for k in positions:
            result = refs[k][1]
            ref = result[TRAJECTORY_KEY]
            RolloutStore.snapshot_into(pipe, result["job_id"], int(ref.get("calls", 0)), int(ref.get("messages", 0)))
        replies = pipe.execute()
        for n, k in enumerate(positions):
            i, result = refs[k]
            messages = [json.loads(m) for m in replies[2 * n + 1]]
            out[i] = _expanded(result, [Call.unpack(blob) for blob in replies[2 * n]], messages)
    return out


def expand_result(client: redis.Redis | Shards, result: dict[str, Any]) -> dict[str, Any]:
    """:func:`expand_results` of one result."""
    return expand_results(client, [result])[0]


def _expanded(result: dict[str, Any], calls: list[Call], messages: list[dict[str, Any]]) -> dict[str, Any]:
    fenced = (result.get("staleness") or {}).get("masked_turns") or []
    out = {k: v for k, v in result.items() if k != TRAJECTORY_KEY}
    out["messages"] = _mark_fenced(assistant_messages(messages, turns_of(calls, with_prompts=False)), fenced)
    if is_harness_result(result):  # a harness's gateway calls: also its segments
        view = harness_fields(calls, fenced)
        out.update(tokens=view["tokens"], token_mode=view["token_mode"],
                   **{HARNESS_KEY: {**result[HARNESS_KEY], "segments": view["segments"], "counts": view["counts"]}})
        return out
    tokens, mode = flatten_calls(calls)
    mask_turns(calls, tokens, mode, fenced)
    out.update(tokens=tokens, token_mode=mode, token_versions=token_versions(calls, tokens, mode))
    return out


def _mark_fenced(annotated: list[dict[str, Any]], fenced: Sequence[int]) -> list[dict[str, Any]]:
    """``stale_masked`` on the assistant messages of the fenced turns: a trainer that builds its
    own masks from the messages (NeMo Gym) sees them too."""
    if fenced:
        fenced_set = set(fenced)
        for i, message in enumerate(annotated):
            if generated_by(message) in fenced_set:  # by its provenance tag, never its position
                annotated[i] = {**message, "stale_masked": True}
    return annotated
