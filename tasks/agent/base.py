"""What the agent loop runs on, as small protocols, and how an episode ends.

The loop needs four things from its caller, each passed explicitly (mini-swe-agent's
``DefaultAgent(model, env)``): a :class:`Policy` that generates the next assistant turn, a
:class:`Sandbox` that runs the tool calls, a :class:`Control` that says how much time is left and
whether the job was cancelled, and a :class:`Sink` that persists the episode's state and turns
after each turn (the rollout room's, :mod:`prorl_celery.rollout.transcript`: a harness's gateway
log saves through the same one). ``tasks/context.py`` implements them for the real stack; ``prorl_celery/fakes`` has
in-process ones for unit tests.

Exceptions (control flow inside the loop, never seen by the caller)::

    EpisodeEnded(reason, answer)   the episode is over: record ``reason`` and return
"""
from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Protocol

from prorl_celery.llm.models import LLMRequest, Turn
from prorl_celery.rollout.transcript import Sink  # noqa: F401  (a protocol of the loop's, defined in the rollout room)
from sandboxes.base import ExecResult


class FinishReason(str, Enum):
    """How an episode ended; the value is what results and the job's state carry."""

    SUBMIT = "submit"              # the agent called submit
    STOP = "stop"                  # a reply without tool calls
    MAX_TURNS = "max_turns"        # the turn budget was spent
    MAX_TOKENS = "max_tokens"      # the episode's generated-token budget was spent
    CONTEXT = "context"            # the context window is exhausted
    FORMAT_ERROR = "format_error"  # too many unusable replies or tool calls in a row
    BUDGET = "budget"              # the stage's time ran out (StageBudgetExceeded is re-raised)


class EpisodeEnded(Exception):
    """Raised inside the loop when the episode is over."""

    def __init__(self, reason: FinishReason, answer: str | None = None):
        super().__init__(reason.value)
        self.reason = reason
        self.answer = answer


class Policy(Protocol):
    """Generates the next assistant turn (token ids, logprobs, text, tool calls)."""

    def generate(self, request: LLMRequest, should_stop: Callable[[], bool]) -> Turn:
        """Raises ContextWindowExceeded when the conversation no longer fits, LLMCallCancelled
        once ``should_stop()`` is true, and the pool's other errors (LLMTimeout,
        BackendUnavailable, LLMRequestRejected), which end the stage."""
        ...


class Sandbox(Protocol):
    """The part of :class:`sandboxes.base.Sandbox` the tools use."""

    def exec(self, command: str, timeout: float | None = None) -> ExecResult: ...

    def read_file(self, path: str) -> bytes:
        """Raises FileNotFoundError, or another OSError (outside the workspace, too large)."""
        ...

    def write_file(self, path: str, data: bytes) -> None:
        """Raises PermissionError outside the workspace or on a read-only path."""
        ...


class Control(Protocol):
    """The stage's budget and cancellation."""

    def check(self) -> None:
        """Raise JobCancelled if the job was cancelled, StageBudgetExceeded if time ran out."""
        ...

    def remaining(self) -> float:
        """Seconds left in the stage."""
        ...

    def stopped(self) -> bool:
        """True once the job was cancelled (or left the stage); never raises."""
        ...


