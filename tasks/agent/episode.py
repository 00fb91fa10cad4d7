"""One episode: its counters in a plain dict (the job's ``state["agent"]``) and its conversation
and turns in a :class:`~prorl_celery.rollout.transcript.Transcript` (appended to the job's rollout at each
save, never rewritten), so that a redelivered run stage continues from the last saved turn."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from prorl_celery.llm.models import Turn
from prorl_celery.rollout.transcript import Transcript
from tasks.agent.base import FinishReason


class AgentOutcome(BaseModel):
    finish_reason: FinishReason
    answer: str | None = Field(None, description="The submit answer, if the agent submitted one.")
    final_text: str = Field("", description="The last assistant message's text.")


class Episode:
    """A view over the episode's dict: ``turns`` (how many), ``bad_calls``, ``generated``
    (tokens), ``llm_s``, ``actions_s``, the editor's ``history``, and at the end
    ``finish_reason``, ``answer`` and ``final_text``; the conversation and the turns themselves
    are the ``transcript``'s (in memory unless the caller gives one over the store)."""

    def __init__(self, data: dict[str, Any], first_messages: list[dict[str, Any]],
                 transcript: Transcript | None = None):
        self.data = data
        self.transcript = Transcript() if transcript is None else transcript
        if not self.transcript.messages:
            self.transcript.messages.extend(first_messages)  # the caller's list stays as it was
        for key, value in (("bad_calls", 0), ("llm_s", 0.0), ("actions_s", 0.0), ("history", {}),
                           ("generated", 0)):
            data.setdefault(key, value)
        data["turns"] = self.transcript.calls

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.transcript.messages

    @property
    def turn_count(self) -> int:
        return self.transcript.calls

    @property
    def last_turn(self) -> Turn | None:
        """The last turn with its full prompt ids (the next prompt extends them)."""
        return self.transcript.last

    @property
    def finished(self) -> FinishReason | None:
        reason = self.data.get("finish_reason")
        return None if reason is None else FinishReason(reason)

    def add_turn(self, turn: Turn, llm_s: float) -> None:
        self.transcript.answer(turn)  # its message stored tagged as this call's answer
        self.data["turns"] = self.transcript.calls
        self.data["llm_s"] += llm_s
        self.data["generated"] += len(turn.response_ids or []) or len((turn.content or "").encode())

    def add_observation(self, message: dict[str, Any], actions_s: float) -> None:
        self.messages.append(message)
        self.data["actions_s"] += actions_s

    def count_bad(self, bad: bool) -> None:
        """One more unusable reply in a row, or (``bad`` false) the run of them is broken."""
        self.data["bad_calls"] = self.data["bad_calls"] + 1 if bad else 0

    def finish(self, reason: FinishReason, answer: str | None = None) -> AgentOutcome:
        self.data["finish_reason"] = reason.value
        if answer is not None:
            self.data["answer"] = answer
        last = next((m for m in reversed(self.messages) if m.get("role") == "assistant"), {})
        self.data["final_text"] = last.get("content") or ""  # for eval, without the transcript
        return AgentOutcome(finish_reason=reason, answer=self.data.get("answer"),
                            final_text=self.data["final_text"])
