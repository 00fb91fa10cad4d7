"""A rollout's turns and conversation as its agent holds them while it runs.

The conversation in full (the next request sends it), the last turn in full (token mode extends
its ids), every turn as its packed record (:mod:`prorl_celery.rollout.store`: what it added, not its
whole prompt), and what came since the last save, which the stage appends to the store in the
same fenced step that saves its state, through a :class:`Sink` (the stage, for the built-in
agent's loop and a harness's gateway log alike). Memory and the bytes written grow with the
trajectory."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from prorl_celery.jobstate import RolloutCounts
from prorl_celery.llm.models import Turn
from prorl_celery.rollout.store import Call, RolloutStore, prompts

TURN_IDS = frozenset({"prompt_ids", "response_ids", "logprobs"})


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
    meta = turn.model_dump(mode="json", exclude=TURN_IDS)
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
    as saved (:meth:`load`); what is added after is pending until :meth:`mark_saved`."""

    def __init__(self, messages: Sequence[dict[str, Any]] = (), records: Sequence[bytes] = (),
                 last: Turn | None = None):
        self.messages: list[dict[str, Any]] = list(messages)
        self.records: list[bytes] = list(records)
        self.last = last
        self._saved = (len(self.records), len(self.messages))

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
        return cls(messages, records, last)

    @property
    def calls(self) -> int:
        return len(self.records)

    def add(self, turn: Turn, extra: dict[str, Any] | None = None) -> None:
        self.records.append(call_of(turn, self.last, extra).pack())
        self.last = turn

    def counts(self) -> dict[str, int]:
        return {"calls": len(self.records), "messages": len(self.messages)}

    def saved_counts(self) -> dict[str, int]:
        return {"calls": self._saved[0], "messages": self._saved[1]}

    def pending(self) -> tuple[list[bytes], list[str]]:
        """What was added since the last save: packed calls and JSON messages."""
        calls, messages = self._saved
        return self.records[calls:], [json.dumps(m, separators=(",", ":")) for m in self.messages[messages:]]

    def has_pending(self) -> bool:
        return self._saved != (len(self.records), len(self.messages))

    def mark_saved(self) -> None:
        self._saved = (len(self.records), len(self.messages))

    def turns(self) -> list[Turn]:
        """Every turn with its full prompt (derived)."""
        return turns_of([Call.unpack(blob) for blob in self.records])
