"""``HarnessRunner``: a black-box harness as the run stage's agent (:class:`tasks.agent.runner.AgentRunner`).

It runs the instance's harness against its session's gateway (:func:`tasks.harnesses.run.run_harness`);
its block in the job's state (``state.harness``) is its record: how it ended, its session, its
route, its time and its fence's counts. A run stage delivered again finds the block: a harness that
had ended is not run again, one that died with its worker runs again from the start
(:func:`tasks.harnesses.run.restart_harness`)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prorl_celery.jobstate import JobState
from prorl_celery.rollout.results import harness_result_fields

if TYPE_CHECKING:
    from tasks.agent.runner import AgentTask
    from tasks.context import StageContext


class HarnessRunner:
    def resume(self, ctx: StageContext, task: AgentTask) -> Any | None:
        from tasks.harnesses.run import restart_harness

        before = ctx.state.harness  # what the delivery that died left
        if before and before.get("finish_reason"):  # it had ended, its calls saved, before the worker died
            return before
        if before:  # it died with its worker: it cannot go on
            restart_harness(ctx, lambda: task.init(ctx))
        return None

    def run(self, ctx: StageContext, task: AgentTask) -> Any:
        from tasks.harnesses.run import run_harness

        return run_harness(ctx, task.instruction(ctx), tools=task.agent_tools(ctx))

    def next_task(self, ctx: StageContext, task: AgentTask) -> None:
        """A new session on the next instruction; the ended run's block is kept in ``harness_steps``."""
        if ctx.state.harness:
            ctx.state.setdefault("harness_steps", []).append(ctx.state.harness)
            ctx.state.harness = None

    def result_fields(self, state: JobState | Mapping[str, Any]) -> dict[str, Any]:
        return harness_result_fields(state)

    def final_answer(self, state: JobState | Mapping[str, Any]) -> tuple[str | None, str]:
        """A harness has no submit: its model's last message (a replay of a kept answer: that
        answer's, :mod:`tasks.harnesses.replay`)."""
        harness = JobState.of(state).harness or {}
        return harness.get("answer"), harness.get("final_text") or ""


HARNESS = HarnessRunner()
