"""The base of the built-in domains: a sandbox, the instance's agent (the built-in one or a harness,
:func:`tasks.agent.runner.runner_for`), and a domain's own scoring."""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from prorl_celery.jobstate import JobState
from sandboxes.base import SandboxSpec
from sandboxes.policy import handler_spec
from tasks.agent import AgentOutcome
from tasks.agent.runner import runner_for, runner_of
from tasks.context import StageContext
from tasks.handlers.base import AgentHandler


class AgentTaskHandler(AgentHandler):
    """init opens the sandbox and calls :meth:`prepare`; run runs the instance's agent (the
    built-in one on :meth:`prompt`, or a harness on :meth:`instruction`) and calls
    :meth:`after_run`; eval returns :meth:`score`. Subclasses fill in those four."""

    default_sandbox: dict[str, Any] = {}

    def sandbox_spec(self, instance: dict[str, Any]) -> SandboxSpec:
        """The instance's ``sandbox`` block over :attr:`default_sandbox`; its limits merged
        field by field, so an instance can lower a default but not lift or drop it."""
        return handler_spec(self.default_sandbox, instance.get("sandbox"))

    def prompt(self, ctx: StageContext) -> list[dict[str, Any]]:
        raise NotImplementedError

    def prepare(self, ctx: StageContext) -> None:
        """Put the task in the sandbox (runs in init, after the sandbox opened)."""

    def after_run(self, ctx: StageContext, outcome: AgentOutcome | dict[str, Any]) -> None:
        """Collect what eval needs from the sandbox (runs at the end of run; ``outcome``: the
        built-in agent's, or a harness's block)."""

    def score(self, ctx: StageContext) -> dict[str, Any]:
        raise NotImplementedError

    # -- the stages -------------------------------------------------------------------------
    def init(self, ctx: StageContext) -> None:
        ctx.open_sandbox(self.sandbox_spec(ctx.instance))
        self.prepare(ctx)
        ctx.save()

    def run(self, ctx: StageContext) -> None:
        if ctx.resumed:
            ctx.sandbox.interrupt()  # a command the dead worker started may still be running
        ctx.admit()  # the staleness bound: held while the trainer is too far ahead
        runner = runner_for(ctx.instance)
        outcome = runner.resume(ctx, self) if ctx.resumed else None
        if outcome is None:
            outcome = runner.run(ctx, self)
        self.after_run(ctx, outcome)
        ctx.save()

    def eval(self, ctx: StageContext) -> dict[str, Any]:
        return self.score(ctx)

    def instruction(self, ctx: StageContext) -> str:
        """The task as a harness gets it: the prompt's user message."""
        return next((m["content"] for m in self.prompt(ctx) if m.get("role") == "user"), "")

    def agent_tools(self, ctx: StageContext) -> Any:
        """The task's MCP servers and skills (:class:`tasks.harnesses.tools.AgentTools`) for a
        harness that takes them; a domain without any: None."""
        return None

    def result_fields(self, state: JobState | Mapping[str, Any]) -> dict[str, Any]:
        """The rollout's fields, from the block its runner left in the state; its conversation and
        ids stay in the job's rollout, referenced by ``trajectory`` (the API builds ``messages``,
        ``tokens`` and ``token_mode`` from it: :mod:`prorl_celery.rollout.views`)."""
        return runner_of(state).result_fields(state)


def mentions(text: str, value: str) -> bool:
    """``value`` in ``text``, not as part of a longer word or number."""
    return re.search(rf"(?<!\w){re.escape(value)}(?!\w)", text) is not None


def final_answer(state: JobState | Mapping[str, Any]) -> tuple[str | None, str]:
    """(the submit answer, the last assistant message's text) of a finished rollout; a harness
    has no submit: its model's last message."""
    return runner_of(state).final_answer(state)
