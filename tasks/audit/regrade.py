"""An answer domain's stored answer re-graded by today's handler (``prorl-celery rescore``).

A domain graded on the final answer or transcript (math, stem, echo, lookup, code, a user's
handler of that kind) scores from what the job's state holds: the built-in agent's ``submit``
answer and last message (``state.agent``), a harness's last message (``state.harness``), kept in
the job record for as long as the job. The cheapest correct re-grade is the handler's own
``eval`` on a copy of that state and the stored instance, in this process, with no job, sandbox or
LLM call (:func:`regrade`). A grader that asks its stage for more (a sandbox to run tests in:
``code``) raises :class:`NeedsStage`; such a domain is replayed as a new job whose agent is the
``replay`` harness holding the stored answer (:func:`answer_instance`), graded by the workers."""
from __future__ import annotations

import copy
from typing import Any

from prorl_celery.jobstate import JobState
from tasks.audit.taskset import AGENT_KEYS


class NeedsStage(Exception):
    """The grader asked its stage for more than the instance and the stored state."""


class GradeContext:
    """What a handler's ``eval`` may read when it re-grades a stored answer; the rest raises."""

    def __init__(self, record: Any):
        self.instance = copy.deepcopy(record.instance)
        self.state = JobState.of(copy.deepcopy(record.state))
        self.sampling_params = copy.deepcopy(record.sampling_params)
        self.job_id = record.job_id

    def remaining(self) -> float:
        return 3600.0

    def __getattr__(self, name: str) -> Any:
        raise NeedsStage(name)


def regrade(record: Any) -> tuple[float | None, str | None]:
    """(today's reward of the stored answer, None) or (None, why there is none); raises
    :class:`NeedsStage` when the grader needs a sandbox or the LLM."""
    from tasks.handlers import get_handler

    result = get_handler(record.data_source).eval(GradeContext(record))
    reward = (result or {}).get("reward")
    return (None, "today's grader gave no reward") if reward is None else (float(reward), None)


def answer_instance(record: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(the instance of a job that replays the stored answer, None) or (None, why it cannot):
    only a handler whose run stage runs the instance's agent (the built-in domains' base) takes one."""
    from tasks.agent.runner import runner_of
    from tasks.handlers import get_handler
    from tasks.handlers.agentic import AgentTaskHandler

    handler = get_handler(record.data_source)
    if not isinstance(handler, AgentTaskHandler) or type(handler).run is not AgentTaskHandler.run:
        return None, f"its grader needs a sandbox and {type(handler).__name__} runs no replay agent: not re-graded"
    state = JobState.of(record.state)
    answer, text = runner_of(state).final_answer(state)
    agent = {"harness": "replay", "final_text": text, **({"answer": answer} if answer is not None else {})}
    return {**{k: v for k, v in record.instance.items() if k not in AGENT_KEYS}, "agent": agent}, None
