"""A rollout's turns and conversation as its agent holds them while it runs.

The conversation in full (the next request sends it), the last turn in full (token mode extends
its ids), every turn as its packed record (:mod:`prorl_celery.rollout.store`: what it added, not its
whole prompt), and what came since the last save, which the stage appends to the store in the
same fenced step that saves its state, through a :class:`Sink` (the stage, for the built-in
agent's loop and a harness's gateway log alike). Memory and the bytes written grow with the trajectory.

Provenance is recorded when a message is stored, never inferred later by position: a message a
call generated is stored with ``{"source": "model", "call": k}`` (k: the call's index in the
rollout); one a gateway's caller sent with ``{"source": "caller", "call": k}`` (the call that
sent it), and an assistant message among those also ``"resent": true`` (no call made it). The
built-in agent's other messages (the task, tool results) carry no tag: no caller wrote them. A
view attaches a call's ids to the message tagged as that call's answer, and to no other
(:func:`generated_by`)."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from prorl_celery.jobstate import RolloutCounts
from prorl_celery.llm.models import Turn
from prorl_celery.rollout.store import Call, RolloutStore, prompts

TURN_IDS = frozenset({"prompt_ids", "response_ids", "logprobs"})
SERVED = ("cached_tokens", "routed_experts")  # stored only where the server reported them
SOURCE, CALL, RESENT = "source", "call", "resent"  # a stored message's provenance (module docstring)
MODEL, CALLER = "model", "caller"
TAGS = (SOURCE, CALL, RESENT)


def generated_by(message: dict[str, Any]) -> int | None:
    """The index of the call that generated ``message`` (None: no call did), from its tag."""
    call = message.get(CALL)
    if message.get(SOURCE) != MODEL or type(call) is not int:
        return None
    return call


def tagged(encoded: bytes, source: str, call: int, resent: bool = False) -> bytes:
    """A message's stored JSON (``encoded``: an object, compact) with its provenance first. Only
    for messages reduced to what a template renders (the gateway's parsers): they never hold a
    key of a tag's name, which would otherwise win over the tag when read."""
    head = b'{"source":"%s","call":%d%s' % (source.encode(), call, b',"resent":true' if resent else b"")
    return head + (b"," + encoded[1:] if len(encoded) > 2 else b"}")


class Sink(Protocol):
    """Persists a running rollout: the job's state and what its transcript gained since the last
    save, in one step, then marks it saved (:meth:`tasks.context.StageContext.save`). The
    built-in agent's loop saves through it after each turn, a gateway session's
    :class:`~prorl_celery.rollout.calllog.CallLog` when its saver flushes."""

    def save(self) -> None: ...


def call_of(turn: Turn, previous: Turn | None, extra: dict[str, Any] | None = None) -> Call:
    """The record of ``turn``, its prompt kept as the ids past what ``previous`` held; ``extra``
    goes into its metadata beside the turn's own fields (a turn read back ignores it)."""
    context = None
    if previous is not None and previous.prompt_ids is not None and previous.response_ids is not None:
        context = previous.prompt_ids + previous.response_ids
    meta = turn.model_dump(mode="json", exclude=TURN_IDS | {k for k in SERVED if getattr(turn, k) is None})
    return Call.of(turn.prompt_ids, turn.response_ids, turn.logprobs, {**meta, **extra} if extra else meta, context)


def turn_of(call: Call, prompt_ids: list[int] | None) -> Turn:
    return Turn.model_validate({**call.meta, "prompt_ids": prompt_ids, "response_ids": call.response_ids,
                                "logprobs": call.logprobs})


def turns_of(calls: Sequence[Call], with_prompts: bool = True) -> list[Turn]:
    """The calls as turns; ``with_prompts`` rebuilds each full prompt (turns x context ids: only
    for a reader that needs them all), else each turn's ``prompt_ids`` is only what it added."""
    if with_prompts:
        return [turn_of(call, prompt) for call, prompt in zip(calls, prompts(calls))]
    return [turn_of(call, call.new_ids) for call in calls]


class Transcript:
    """The conversation (``messages``, appended to in place), the packed record of every turn,
    the last turn in full, and the counts already saved: what the constructor is given counts
    as saved (:meth:`load`); what is added after is pending until :meth:`mark_saved`.

    A message is a dict (the built-in agent sends them again) or its stored JSON already
    (bytes, tagged: the gateway's, :meth:`add_stored`); an answer added with :meth:`answer` is
    tagged as its call's when it is saved. ``size`` counts the bytes of the records and of the
    messages stored as JSON."""

    def __init__(self, messages: Sequence[dict[str, Any]] = (), records: Sequence[bytes] = (),
                 last: Turn | None = None):
        self.messages: list[dict[str, Any] | bytes] = list(messages)
        self.records: list[bytes] = list(records)
        self.last = last
        self._saved = (len(self.records), len(self.messages))
        self._answers: dict[int, int] = {}  # index of a dict message -> the call that generated it
        self._loaded: Sequence[dict[str, Any]] = ()  # the messages read from the store, as stored
        self.size = sum(map(len, self.records)) + sum(len(m) for m in self.messages if isinstance(m, bytes))

    @classmethod
    def load(cls, store: RolloutStore, rollout_id: str,
             counts: RolloutCounts | dict[str, int] | None) -> Transcript:
        """The saved transcript of ``rollout_id``: as many calls and messages as ``counts`` says
        were saved (what lies past them was written by a delivery that lost its job)."""
        saved = RolloutCounts.model_validate(counts or {})
        records, messages = store.snapshot(rollout_id, saved.calls, saved.messages)
        last = None
        if records:
            calls = [Call.unpack(blob) for blob in records]
            *_, prompt = prompts(calls)
            last = turn_of(calls[-1], prompt)
        out = cls([{k: v for k, v in m.items() if k not in TAGS} for m in messages], records, last)
        out._loaded = messages  # as stored, tags and all: what :meth:`since` sends again
        out.size += sum(len(json.dumps(m, separators=(",", ":"))) for m in messages)
        return out  # the tags stay in the store; an agent sends its messages on without them

    @property
    def calls(self) -> int:
        return len(self.records)

    def add(self, turn: Turn, extra: dict[str, Any] | None = None) -> int:
        """Record ``turn`` as the next call; returns its index."""
        record = call_of(turn, self.last, extra).pack()
        self.records.append(record)
        self.size += len(record)
        self.last = turn
        return len(self.records) - 1

    def answer(self, turn: Turn, extra: dict[str, Any] | None = None) -> None:
        """Record ``turn`` and append its message to the conversation, tagged as its answer."""
        k = self.add(turn, extra)
        self._answers[len(self.messages)] = k
        self.messages.append(turn.message)

    def add_stored(self, encoded: Sequence[bytes]) -> None:
        """Append messages already in their stored form (tagged JSON)."""
        self.messages.extend(encoded)
        self.size += sum(map(len, encoded))

    def counts(self) -> dict[str, int]:
        return {"calls": len(self.records), "messages": len(self.messages)}

    def saved_counts(self) -> dict[str, int]:
        return {"calls": self._saved[0], "messages": self._saved[1]}

    def pending(self) -> tuple[list[bytes], list[str | bytes]]:
        """What was added since the last save: packed calls and JSON messages."""
        calls, messages = self._saved
        return self.records[calls:], [self._stored(i) for i in range(messages, len(self.messages))]

    def since(self, calls: int, messages: int) -> tuple[list[bytes], list[str | bytes]]:
        """The packed calls and stored messages from positions ``calls`` and ``messages`` on, saved
        or not: a store that lost its last writes is sent them again (prorl_celery/shards.py)."""
        loaded = self._loaded
        return self.records[calls:], [json.dumps(loaded[i], separators=(",", ":")) if i < len(loaded)
                                      else self._stored(i) for i in range(messages, len(self.messages))]

    def _stored(self, i: int) -> str | bytes:
        message = self.messages[i]
        if isinstance(message, bytes):
            return message
        if i in self._answers:
            message = {**message, SOURCE: MODEL, CALL: self._answers[i]}
        return json.dumps(message, separators=(",", ":"))

    def has_pending(self) -> bool:
        return self._saved != (len(self.records), len(self.messages))

    def mark_saved(self) -> None:
        self._saved = (len(self.records), len(self.messages))

    def turns(self) -> list[Turn]:
        """Every turn with its full prompt (derived)."""
        return turns_of([Call.unpack(blob) for blob in self.records])
