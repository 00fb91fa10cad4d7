"""The one status vocabulary, used by the job store, the API and the stage tasks."""
from __future__ import annotations

from enum import Enum


class JobStatus(str, Enum):
    QUEUED = "queued"
    INIT = "init"
    RUN = "run"
    EVAL = "eval"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    def __str__(self) -> str:
        return self.value


TERMINAL = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.TIMEOUT})
STAGES = (JobStatus.INIT, JobStatus.RUN, JobStatus.EVAL)
_ENDINGS = {JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.TIMEOUT}

# Which statuses may follow which. A stage may follow itself (a redelivered stage resumes);
# any stage may go back to queued (an infrastructure fault: the job runs again from init, see
# tasks/retry.py); a terminal status is followed by nothing.
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.INIT, *_ENDINGS}),
    JobStatus.INIT: frozenset({JobStatus.INIT, JobStatus.RUN, JobStatus.QUEUED, *_ENDINGS}),
    JobStatus.RUN: frozenset({JobStatus.RUN, JobStatus.EVAL, JobStatus.QUEUED, *_ENDINGS}),
    JobStatus.EVAL: frozenset({JobStatus.EVAL, JobStatus.COMPLETED, JobStatus.QUEUED, *_ENDINGS}),
    **{status: frozenset() for status in TERMINAL},
}


def sources_of(target: JobStatus) -> list[JobStatus]:
    """Statuses from which ``target`` may be reached."""
    return [src for src, targets in TRANSITIONS.items() if target in targets]


def stage_index(status: JobStatus) -> int:
    """Order of a status along the pipeline: queued 0, init 1, run 2, eval 3, terminal 4."""
    if status.terminal:
        return 4
    return 0 if status is JobStatus.QUEUED else STAGES.index(status) + 1
