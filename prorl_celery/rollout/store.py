"""A rollout's LLM calls and conversation, each stored once and appended per call.

A call record holds only what the call added: ``keep`` (how many ids of the rollout's context,
the previous call's prompt and response, its prompt starts with), ``new_ids`` (the prompt's ids
past them), the response ids, their logprobs, and the call's metadata (backend, weight version,
timing ...). The full prompt of call k is derived (:func:`prompts`), never stored again, so what
a rollout stores grows with its trajectory, not with turns x context. A prompt that re-renders
the history differently keeps only its common prefix and stores the rest: nothing is lost.

Redis: two lists per rollout, :func:`keys.rollout_calls` (one packed record per call) and
:func:`keys.rollout_messages` (one JSON message each). Records are appended, never rewritten.
A reader takes the first n, n being the count its writer saved: a record past it is a write
that lost a race (a delivery of a job that moved on), trimmed by the next fenced save
(:meth:`prorl_celery.jobs.JobStore.save_state`).

A packed record, little-endian: uint32 length of the metadata JSON, that JSON (with ``keep`` and
the lengths of the three arrays, -1 for an absent one), int32 new prompt ids, int32 response ids,
float64 logprobs (exactly as the server sent them)::

    store = RolloutStore(redis)
    store.append(rid, [Call.of(prompt_ids, response_ids, logprobs, meta, context=earlier)])
    store.read(rid)         # every call, in order      store.last(rid)      # the last one
    store.prompt(rid, k)    # the full prompt of call k  store.messages(rid)  # the conversation
"""
from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from prorl_celery import jsonfast, keys
from prorl_celery.errors import QuotaExceeded
from prorl_celery.shards import Shards

_LEN = struct.Struct("<I")
_SWAP = sys.byteorder == "big"  # records are little-endian on every node


def _ints(values: Sequence[int] | None) -> bytes:
    return b"" if values is None else _packed(array("i", values))


def _floats(values: Sequence[float] | None) -> bytes:
    return b"" if values is None else _packed(array("d", values))


def _packed(values: array) -> bytes:
    if _SWAP:
        values.byteswap()
    return values.tobytes()


def _unpacked(code: str, blob: bytes, start: int, n: int) -> tuple[list | None, int]:
    if n < 0:
        return None, start
    values = array(code)
    end = start + n * values.itemsize
    values.frombytes(blob[start:end])
    if _SWAP:
        values.byteswap()
    return values.tolist(), end


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (slice compares, no Python loop over ids)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class Call:
    """One LLM call as stored: what it added to the rollout's ids, and its metadata."""

    keep: int = 0
    new_ids: list[int] | None = None
    response_ids: list[int] | None = None
    logprobs: list[float] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, prompt_ids: Sequence[int] | None, response_ids: Sequence[int] | None,
           logprobs: Sequence[float] | None, meta: dict[str, Any],
           context: Sequence[int] | None = None) -> Call:
        """The record of a call whose prompt was ``prompt_ids``, given the rollout's ``context``
        (the previous call's prompt and response; None for the first call or unknown ids)."""
        keep = common_prefix(context, prompt_ids) if prompt_ids is not None and context else 0
        return cls(keep, None if prompt_ids is None else list(prompt_ids[keep:]),
                   None if response_ids is None else list(response_ids),
                   None if logprobs is None else list(logprobs), meta)

    def pack(self) -> bytes:
        lengths = [-1 if x is None else len(x) for x in (self.new_ids, self.response_ids, self.logprobs)]
        head = jsonfast.dumps({**self.meta, "_k": self.keep, "_n": lengths})
        return b"".join((_LEN.pack(len(head)), head, _ints(self.new_ids), _ints(self.response_ids),
                         _floats(self.logprobs)))

    @classmethod
    def unpack(cls, blob: bytes) -> Call:
        (size,) = _LEN.unpack_from(blob)
        meta = json.loads(blob[4:4 + size])
        keep, (n_new, n_resp, n_lp) = meta.pop("_k"), meta.pop("_n")
        new, at = _unpacked("i", blob, 4 + size, n_new)
        response, at = _unpacked("i", blob, at, n_resp)
        logprobs, _ = _unpacked("d", blob, at, n_lp)
        return cls(keep, new, response, logprobs, meta)


def prompts(calls: Sequence[Call]) -> Iterator[list[int] | None]:
    """The full prompt of each call, rebuilt from the records (None where the ids are unknown)."""
    context: list[int] = []
    for call in calls:
        prompt = None if call.new_ids is None else context[:call.keep] + call.new_ids
        yield prompt
        context = prompt + call.response_ids if prompt is not None and call.response_ids is not None else []


def is_exact(calls: Sequence[Call]) -> bool:
    """True when every call has ids and each prompt extends the previous prompt and response
    id for id (then the rollout is one sequence: :func:`prorl_celery.rollout.trajectory.flatten_calls`)."""
    length = 0
    for k, call in enumerate(calls):
        if call.new_ids is None or call.response_ids is None or (k and call.keep != length):
            return False
        length = call.keep + len(call.new_ids) + len(call.response_ids)
    return bool(calls)


@dataclass(frozen=True)
class RolloutQuota:
    """Byte quotas of what a rollout stores: each conversation message (its JSON), what one call
    adds, and the whole rollout (conversation and call records). A writer that takes input from
    model-controlled code (the gateway) checks them before storing, and is refused with
    :class:`QuotaExceeded` (413, naming the setting) rather than growing the store."""

    message_bytes: int = 1 << 20
    call_bytes: int = 4 << 20
    rollout_bytes: int = 32 << 20

    @classmethod
    def from_settings(cls) -> RolloutQuota:
        from config.settings import get_settings

        s = get_settings()
        return cls(s.rollout_message_max_bytes, s.rollout_call_max_bytes, s.rollout_max_bytes)

    _LIMITS = {"rollout_message_max_bytes": "message_bytes", "rollout_call_max_bytes": "call_bytes",
               "rollout_max_bytes": "rollout_bytes"}

    def exceeded(self, limit: str, size: int, what: str, field: str | None = None) -> QuotaExceeded:
        """The refusal of ``what`` (``size`` bytes) by the quota of setting ``limit``."""
        cap = getattr(self, self._LIMITS[limit])
        return QuotaExceeded(f"{what} would store {size} bytes, past {limit} ({cap} bytes)", limit, field)

    def encode(self, messages: Sequence[dict[str, Any]], first: int = 0) -> list[bytes]:
        """Each message's stored JSON, checked against the message and call quotas (``first``:
        the index of ``messages[0]`` in what the caller sent, for the error's field)."""
        out, total = [], 0
        for i, message in enumerate(messages):
            data = self._encoded(message, f"messages[{first + i}]")
            total += len(data)
            out.append(data)
        if total > self.call_bytes:
            raise self.exceeded("rollout_call_max_bytes", total, "the call's messages", "messages")
        return out


    def _encoded(self, message: dict[str, Any], where: str) -> bytes:
        content = message.get("content")
        size = len(content) if isinstance(content, str) else 0  # a text past the quota: refused uncopied
        if size <= self.message_bytes:
            data = jsonfast.dumps(message)
            size = len(data)
        if size > self.message_bytes:
            raise self.exceeded("rollout_message_max_bytes", size, where, where)
        return data


class RolloutStore:
    """A rollout's records in Redis (the lists of :mod:`prorl_celery.keys`). ``append`` is not
    fenced: a caller that may race another writer of the same rollout appends through
    :meth:`prorl_celery.jobs.JobStore.save_state` instead."""

    def __init__(self, where: redis.Redis | Shards, ttl_s: int | None = None):
        self.shards = Shards.of(where)  # each rollout on its shard (prorl_celery/shards.py)
        self.redis = self.shards.head
        self.ttl_s = ttl_s

    def append(self, rollout_id: str, calls: Sequence[Call | bytes],
               messages: Sequence[dict[str, Any] | str | bytes] = ()) -> int:
        """Append calls (and conversation messages), each as a :class:`Call` or already packed
        (bytes; a message: its JSON, text or bytes); returns the number of calls stored now."""
        pipe = self.shards.store_for(rollout_id).pipeline(transaction=True)
        if calls:
            pipe.rpush(keys.rollout_calls(rollout_id), *(c if isinstance(c, bytes) else c.pack() for c in calls))
        if messages:
            pipe.rpush(keys.rollout_messages(rollout_id),
                       *(m if isinstance(m, (str, bytes)) else json.dumps(m, separators=(",", ":")) for m in messages))
        if self.ttl_s:
            pipe.expire(keys.rollout_calls(rollout_id), self.ttl_s)
            pipe.expire(keys.rollout_messages(rollout_id), self.ttl_s)
        pipe.llen(keys.rollout_calls(rollout_id))
        return int(pipe.execute()[-1])

    def read(self, rollout_id: str, count: int | None = None) -> list[Call]:
        """The first ``count`` calls (all if None), in order."""
        return [Call.unpack(blob) for blob in self._range(rollout_id, keys.rollout_calls(rollout_id), count)]

    def last(self, rollout_id: str) -> Call | None:
        blob = self.shards.store_for(rollout_id).lindex(keys.rollout_calls(rollout_id), -1)
        return None if blob is None else Call.unpack(blob)

    def prompt(self, rollout_id: str, k: int) -> list[int] | None:
        """The full prompt of call ``k`` (0-based), rebuilt from calls 0..k."""
        calls = self.read(rollout_id, k + 1)
        if len(calls) <= k:
            raise IndexError(f"rollout {rollout_id} has {len(calls)} calls, not {k + 1}")
        return list(prompts(calls))[-1]

    def messages(self, rollout_id: str, count: int | None = None) -> list[dict[str, Any]]:
        """The first ``count`` conversation messages (all if None)."""
        return [json.loads(raw) for raw in self._range(rollout_id, keys.rollout_messages(rollout_id), count)]

    def snapshot(self, rollout_id: str, calls: int | None, messages: int | None
                 ) -> tuple[list[bytes], list[dict[str, Any]]]:
        """The first ``calls`` packed records and ``messages`` messages (None: all), in one round trip."""
        pipe = self.shards.store_for(rollout_id).pipeline(transaction=False)
        self.snapshot_into(pipe, rollout_id, calls, messages)
        raw_calls, raw_messages = pipe.execute()
        return raw_calls, [json.loads(m) for m in raw_messages]

    @staticmethod
    def snapshot_into(pipe: redis.client.Pipeline, rollout_id: str, calls: int | None, messages: int | None) -> None:
        """Queue :meth:`snapshot`'s two reads on ``pipe`` (many rollouts in one round trip), a
        pipeline of the rollout's shard (:meth:`prorl_celery.shards.Shards.by_store`)."""
        pipe.lrange(keys.rollout_calls(rollout_id), *_span(calls))
        pipe.lrange(keys.rollout_messages(rollout_id), *_span(messages))

    def delete(self, rollout_id: str) -> None:
        self.shards.store_for(rollout_id).delete(keys.rollout_calls(rollout_id), keys.rollout_messages(rollout_id))

    def _range(self, rollout_id: str, key: str, count: int | None) -> list[bytes]:
        return self.shards.store_for(rollout_id).lrange(key, *_span(count))


def _span(count: int | None) -> tuple[int, int]:
    """LRANGE bounds of the first ``count`` elements (None: all; 0: none, as an empty range)."""
    return (0, -1) if count is None else (0, count - 1) if count > 0 else (1, 0)
