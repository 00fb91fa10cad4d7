"""The base of the built-in domains: a sandbox, the built-in agent, and a domain's own scoring."""
from __future__ import annotations

from typing import Any

from tasks.agent import AgentConfig, AgentOutcome
from prorl_celery.jobstate import ADMISSION_KEY, JobState, RolloutCounts
from prorl_celery.rollout.trajectory import TRAJECTORY_KEY
from sandboxes.base import SandboxSpec
from sandboxes.policy import handler_spec
from prorl_celery.rollout.results import result_block
from tasks.context import StageContext
from tasks.handlers.base import AgentHandler
from tasks.harnesses import is_harness_agent


class AgentTaskHandler(AgentHandler):
    """init opens the sandbox and calls :meth:`prepare`; run runs the built-in agent on
    :meth:`prompt` and calls :meth:`after_run`; eval returns :meth:`score`. Subclasses fill in
    those four."""

    default_sandbox: dict[str, Any] = {}

    def sandbox_spec(self, instance: dict[str, Any]) -> SandboxSpec:
        """The instance's ``sandbox`` block over :attr:`default_sandbox`; its limits merged
        field by field, so an instance can lower a default but not lift or drop it."""
        return handler_spec(self.default_sandbox, instance.get("sandbox"))

    def prompt(self, ctx: StageContext) -> list[dict[str, Any]]:
        raise NotImplementedError

    def prepare(self, ctx: StageContext) -> None:
        """Put the task in the sandbox (runs in init, after the sandbox opened)."""

    def after_run(self, ctx: StageContext, outcome: AgentOutcome) -> None:
        """Collect what eval needs from the sandbox (runs at the end of run)."""

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
        if is_harness_agent(ctx.instance):  # a black-box harness against its session's gateway
            from tasks.harnesses.run import restart_harness, run_harness

            before = ctx.state.get("harness") if ctx.resumed else None  # a delivery that died in it
            if before and before.get("finish_reason"):  # it had ended, its calls saved, before the worker died
                outcome = before
            else:
                if before:  # it died with its worker: it cannot go on
                    restart_harness(ctx, lambda: self.init(ctx))
                outcome = run_harness(ctx, self.instruction(ctx))
        else:
            outcome = ctx.agent(AgentConfig.model_validate(ctx.sampling_params)).run(self.prompt(ctx))
        self.after_run(ctx, outcome)
        ctx.save()

    def eval(self, ctx: StageContext) -> dict[str, Any]:
        return self.score(ctx)

    def instruction(self, ctx: StageContext) -> str:
        """The task as a harness gets it: the prompt's user message."""
        return next((m["content"] for m in self.prompt(ctx) if m.get("role") == "user"), "")

    def result_fields(self, state: dict[str, Any]) -> dict[str, Any]:
        """The episode's fields; its conversation and ids stay in the job's rollout, referenced
        by ``trajectory`` (the API builds ``messages``, ``tokens`` and ``token_mode`` from it:
        :func:`prorl_celery.rollout.trajectory.expand_results`). A harness's come from its gateway calls."""
        if "harness" in state:
            from prorl_celery.rollout.results import harness_result_fields

            return harness_result_fields(state)
        agent = state.get("agent") or {}
        saved = (JobState.of(state).rollout or RolloutCounts()).model_dump()
        out = {TRAJECTORY_KEY: {"calls": saved.get("calls", 0), "messages": saved.get("messages", 0)},
               "turns": saved.get("calls", 0), "finish_reason": agent.get("finish_reason"),
               "answer": agent.get("answer"),
               "timing": {"llm": agent.get("llm_s", 0.0), "actions": agent.get("actions_s", 0.0)}}
        staleness = staleness_fields(state)
        if staleness:
            out["staleness"] = staleness
        return out


def staleness_fields(state: dict[str, Any]) -> dict[str, Any] | None:
    """The result's ``staleness``: the bound, the fence, the turns masked, the turns regenerated
    and their tokens, the largest lag kept unmasked, and the admission wait; None without a bound."""
    return result_block((state.get("agent") or {}).get("staleness"), state.get(ADMISSION_KEY))


def final_answer(state: dict[str, Any]) -> tuple[str | None, str]:
    """(the submit answer, the last assistant message's text) of a finished episode; a harness
    has no submit: its model's last message."""
    if "harness" in state:
        return None, state["harness"].get("final_text") or ""
    agent = state.get("agent") or {}
    return agent.get("answer"), agent.get("final_text") or ""
