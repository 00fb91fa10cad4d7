"""An answer domain's stored answer re-graded in process by today's handler (``prorl-celery rescore``).

A domain graded on the final answer or transcript (math, stem, echo, lookup, a user's handler of
that kind) scores from what the job's state holds: the built-in agent's ``submit`` answer and last
message (``state.agent``), a harness's last message (``state.harness``), kept in the job record
for as long as the job. Re-grading it is the handler's own ``eval`` on a copy of that state and
the stored instance, here, with no job, sandbox or LLM call: the cheapest path that runs today's
grading code. A grader that asks its stage for anything else (a sandbox to run tests in: ``code``;
the LLM) is refused in process and reported as such."""
from __future__ import annotations

import copy
from typing import Any

from prorl_celery.jobstate import JobState


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
    """(today's reward of the stored answer, None) or (None, why it cannot be re-graded here)."""
    from tasks.handlers import get_handler

    handler = get_handler(record.data_source)
    try:
        result = handler.eval(GradeContext(record))
    except NeedsStage as exc:
        return None, f"its grader needs the stage's {exc} (a sandbox or the LLM): not re-graded in process"
    reward = (result or {}).get("reward")
    return (None, "today's grader gave no reward") if reward is None else (float(reward), None)
