"""The agent seam: what runs a rollout in the run stage, chosen once per instance.

Two kinds of agent run a rollout: the built-in agent (:class:`BuiltinAgent`, the loop of this
package) and a black-box harness behind its session's gateway
(:class:`tasks.harnesses.runner.HarnessRunner`). A handler asks :func:`runner_for` for its
instance's runner and calls it; it never tells the two apart. Both record the same way: their
calls on the job's rollout through the stage (the loop's ``Sink``; the gateway's
:class:`~prorl_celery.rollout.calllog.CallLog` saves through the same one), their own block in
the job's state (``state.agent``, ``state.harness``), fenced by the same staleness fence and
generating through the same LLM pool (both built by the stage,
:meth:`tasks.context.StageContext.staleness_fence` and :meth:`~tasks.context.StageContext.llm_pool`).
The result's fields are the rollout room's (:mod:`prorl_celery.rollout.results`).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from prorl_celery.jobstate import AGENT_KEY, JobState
from prorl_celery.rollout.results import agent_result_fields

if TYPE_CHECKING:
    from tasks.context import StageContext
    from tasks.harnesses.tools import AgentTools


class AgentTask(Protocol):
    """What a runner asks of the task's handler (:class:`tasks.handlers.agentic.AgentTaskHandler`)."""

    def prompt(self, ctx: StageContext) -> list[dict[str, Any]]:
        """The conversation the built-in agent starts from."""
        ...

    def instruction(self, ctx: StageContext) -> str:
        """The task as a harness gets it."""
        ...

    def init(self, ctx: StageContext) -> None:
        """The init stage again: a fresh sandbox with the task in it."""
        ...

    def agent_tools(self, ctx: StageContext) -> AgentTools | None:
        """The task's MCP servers and skills for a harness that takes them (None: none)."""
        ...


class AgentRunner(Protocol):
    """One kind of agent: how it runs, how a redelivered run stage resumes it, and what the
    result and eval read of what it left in the job's state."""

    def resume(self, ctx: StageContext, task: AgentTask) -> Any | None:
        """A run stage delivered again (its worker died): the outcome if the agent had ended
        before, else None once it is ready to :meth:`run` again."""
        ...

    def run(self, ctx: StageContext, task: AgentTask) -> Any:
        """Run the agent to its end in the job's sandbox; its outcome (the handler's
        ``after_run`` gets it)."""
        ...

    def next_task(self, ctx: StageContext, task: AgentTask) -> None:
        """Before :meth:`run` again on the next step of a multi-step task (whose instruction
        ``task.instruction(ctx)`` now gives): the ended run is put behind."""
        ...

    def result_fields(self, state: JobState | Mapping[str, Any]) -> dict[str, Any]:
        """The result's fields of the rollout this runner left in ``state``."""
        ...

    def final_answer(self, state: JobState | Mapping[str, Any]) -> tuple[str | None, str]:
        """(the submit answer, the last assistant message's text) of the ended rollout."""
        ...


class BuiltinAgent:
    """The built-in agent (:class:`tasks.agent.loop.DefaultAgent`) on the job: its episode in
    ``state.agent``, each turn saved by the stage."""

    def resume(self, ctx: StageContext, task: AgentTask) -> Any | None:
        return None  # the loop goes on from its last saved turn (an ended episode returns at once)

    def run(self, ctx: StageContext, task: AgentTask) -> Any:
        from tasks.agent.config import AgentConfig

        return ctx.agent(AgentConfig.model_validate(ctx.sampling_params)).run(task.prompt(ctx))

    def next_task(self, ctx: StageContext, task: AgentTask) -> None:
        """The same conversation goes on: the next instruction is a new user message after the
        last turn (the prompt extends the ids generated so far), the episode open again."""
        episode = ctx.state.setdefault(AGENT_KEY, {})
        for key in ("finish_reason", "answer", "final_text"):
            episode.pop(key, None)
        ctx.transcript.messages.append({"role": "user", "content": task.instruction(ctx)})

    def result_fields(self, state: JobState | Mapping[str, Any]) -> dict[str, Any]:
        return agent_result_fields(state)

    def final_answer(self, state: JobState | Mapping[str, Any]) -> tuple[str | None, str]:
        agent = JobState.of(state).agent or {}
        return agent.get("answer"), agent.get("final_text") or ""


BUILTIN = BuiltinAgent()


def runner_for(instance: Mapping[str, Any]) -> AgentRunner:
    """The instance's runner: a harness when its ``agent`` block names one, else the built-in agent."""
    from tasks.harnesses import is_harness_agent

    if is_harness_agent(instance):
        from tasks.harnesses.runner import HARNESS

        return HARNESS
    return BUILTIN


def runner_of(state: JobState | Mapping[str, Any]) -> AgentRunner:
    """The runner whose rollout ``state`` holds (the run stage records it: its block). A job that
    ended before its run stage holds none: the built-in agent's fields, empty."""
    if JobState.of(state).harness is not None:
        from tasks.harnesses.runner import HARNESS

        return HARNESS
    return BUILTIN
