"""The multi-turn loop: ask the policy for a turn, run its tool calls in the sandbox, repeat.

``DefaultAgent(policy, sandbox, config, control=..., sink=..., state=..., transcript=...)`` runs
one episode; the episode's dict (``state``) and what the ``transcript`` gained (the conversation
and the turns) are saved through the sink after each turn, so a run stage
delivered again after its worker died continues from the last saved turn. Every way an episode
ends is a :class:`~tasks.agent.base.FinishReason`, recorded as ``finish_reason``. Errors the
caller must see pass through: JobCancelled (from ``control.check``), LLMCallCancelled and the
pool's other errors (from the policy), a sandbox's own failures; StageBudgetExceeded is
recorded as ``budget`` first.
"""
from __future__ import annotations

import math
import time
from typing import Any

from prorl_celery.errors import ContextWindowExceeded, StageBudgetExceeded
from prorl_celery.llm.models import Turn
from prorl_celery.rollout.transcript import Transcript
from tasks.agent.actions import Actions
from tasks.agent.base import Control, EpisodeEnded, FinishReason, Policy, Sandbox, Sink
from tasks.agent.config import AgentConfig, Timeouts
from tasks.agent.editor import Editor
from tasks.agent.episode import AgentOutcome, Episode
from tasks.agent.fence import StalenessFence

FORMAT_HINT = ("Your reply could not be used ({error}). Call one of the tools bash, str_replace_editor or "
               "submit with valid JSON arguments.")


class NoLimits:
    """A :class:`Control` without a deadline or cancellation (tests, tools)."""

    def check(self) -> None:
        return None

    def remaining(self) -> float:
        return math.inf

    def stopped(self) -> bool:
        return False


class NoSink:
    """A :class:`Sink` that keeps the state in memory only."""

    def save(self) -> None:
        return None


class DefaultAgent:
    def __init__(self, policy: Policy, sandbox: Sandbox, config: AgentConfig, *,
                 control: Control | None = None, sink: Sink | None = None,
                 state: dict[str, Any] | None = None, timeouts: Timeouts | None = None,
                 transcript: Transcript | None = None, fence: StalenessFence | None = None):
        self.policy = policy
        self.sandbox = sandbox
        self.config = config
        self.control = control or NoLimits()
        self.sink = sink or NoSink()
        self.state = {} if state is None else state
        self.timeouts = timeouts or Timeouts.from_settings(config)
        self.transcript = Transcript() if transcript is None else transcript
        self.fence = fence

    def run(self, first_messages: list[dict[str, Any]]) -> AgentOutcome:
        """Run (or resume) the episode to its end."""
        episode = Episode(self.state, first_messages, self.transcript)
        if episode.finished is not None:
            return self._end(episode, episode.finished)
        actions = Actions(self.sandbox, Editor(self.sandbox, episode.data["history"]), self.control,
                          self.timeouts.action_s)
        try:
            while True:
                self._step(episode, actions)
                self.sink.save()
        except EpisodeEnded as end:
            return self._end(episode, end.reason, end.answer)
        except StageBudgetExceeded:
            self._end(episode, FinishReason.BUDGET)
            raise

    def _end(self, episode: Episode, reason: FinishReason, answer: str | None = None) -> AgentOutcome:
        if self.fence is not None:  # what the result holds is within the bound, or masked
            self.fence.fence(episode.data)
        outcome = episode.finish(reason, answer)
        self.sink.save()
        return outcome

    def _step(self, episode: Episode, actions: Actions) -> None:
        config = self.config
        if episode.turn_count >= config.max_turns:
            raise EpisodeEnded(FinishReason.MAX_TURNS)
        if config.max_total_tokens and episode.data["generated"] >= config.max_total_tokens:
            raise EpisodeEnded(FinishReason.MAX_TOKENS)
        self.control.check()
        if self.fence is not None:
            self.fence.fence(episode.data)
        turn = self._generate(episode)
        if turn.tool_calls:
            acted = actions.run(episode, turn)
            if acted.submitted is not None:
                raise EpisodeEnded(FinishReason.SUBMIT, acted.submitted)
            episode.count_bad(acted.all_bad)
        elif turn.format_error:
            episode.count_bad(True)
            episode.messages.append({"role": "user", "content": FORMAT_HINT.format(error=turn.format_error)})
        else:
            raise EpisodeEnded(FinishReason.STOP)
        if episode.data["bad_calls"] >= config.max_bad_calls:
            raise EpisodeEnded(FinishReason.FORMAT_ERROR)

    def _generate(self, episode: Episode) -> Turn:
        previous = episode.last_turn
        timeout = max(0.1, min(self.timeouts.llm_call_s, self.control.remaining()))
        request = self.config.request(list(episode.messages), previous, timeout)
        started = time.monotonic()
        try:
            turn = self.policy.generate(request, self.control.stopped)
            if self.fence is not None:
                turn = self.fence.fresh(turn, lambda: self.policy.generate(request, self.control.stopped),
                                        episode.data)
        except ContextWindowExceeded:
            raise EpisodeEnded(FinishReason.CONTEXT) from None
        episode.add_turn(turn, time.monotonic() - started)
        return turn
