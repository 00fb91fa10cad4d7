"""The one status vocabulary, used by the job store, the API and the stage tasks.

The pipeline's order is stated once, in :data:`PIPELINE`; the stages, :func:`next_stage`,
:func:`previous_stage` and the transition table the job store applies are derived from it.
"""
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


class StageState(str, Enum):
    """Where the stage named by a job's status is (the ``stage_state`` field of its record)."""

    NONE = ""  # queued (also after a retry), or terminal
    RUNNING = "running"  # a delivery holds the stage's lease and executes it
    DONE = "done"  # the stage finished; the job waits for the next stage's message
    REDISPATCHED = "redispatched"  # the sweep re-sent the stage after its lease lapsed

    def __str__(self) -> str:
        return self.value


PIPELINE = (JobStatus.QUEUED, JobStatus.INIT, JobStatus.RUN, JobStatus.EVAL, JobStatus.COMPLETED)
"""The statuses a job that succeeds passes through, in order."""
TERMINAL = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.TIMEOUT})
STAGES = PIPELINE[1:-1]
_ENDINGS = TERMINAL - {JobStatus.COMPLETED}  # reachable from any active status


def next_stage(status: JobStatus) -> JobStatus | None:
    """The status that follows ``status`` once it succeeds (eval -> completed); None if terminal."""
    if status.terminal:
        return None
    return PIPELINE[PIPELINE.index(status) + 1]


def previous_stage(status: JobStatus) -> JobStatus | None:
    """The status that ``status`` follows along the pipeline; None for queued and the endings."""
    if status not in PIPELINE or status is JobStatus.QUEUED:
        return None
    return PIPELINE[PIPELINE.index(status) - 1]


def _followers(status: JobStatus) -> frozenset[JobStatus]:
    if status.terminal:
        return frozenset()
    again = {status, JobStatus.QUEUED} if status in STAGES else set()
    return frozenset({next_stage(status), *_ENDINGS, *again})


TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {status: _followers(status) for status in JobStatus}
"""Which statuses may follow which: the next one along the pipeline; failed, cancelled or timeout
from any active status; a stage may follow itself (a redelivered stage resumes) and any stage may
go back to queued (an infrastructure fault: the job runs again from init, see tasks/retry.py);
a terminal status is followed by nothing. The job store refuses every other change."""

_SOURCES: dict[JobStatus, frozenset[JobStatus]] = {
    target: frozenset(src for src, targets in TRANSITIONS.items() if target in targets) for target in JobStatus}


def sources_for(target: JobStatus) -> frozenset[JobStatus]:
    """The statuses from which the table allows ``target``."""
    return _SOURCES[target]


def stage_index(status: JobStatus) -> int:
    """Order of a status along the pipeline: queued 0, init 1, run 2, eval 3, terminal 4."""
    return len(PIPELINE) - 1 if status.terminal else PIPELINE.index(status)
