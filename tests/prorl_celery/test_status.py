"""The transition table and the pipeline order, without Redis."""
from __future__ import annotations

import pytest

from prorl_celery.status import (PIPELINE, STAGES, TERMINAL, TRANSITIONS, JobStatus, StageState,
                                 next_stage, previous_stage, sources_for, stage_index)

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

Q, I, R, E = JobStatus.QUEUED, JobStatus.INIT, JobStatus.RUN, JobStatus.EVAL
ENDINGS = {JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.TIMEOUT}


def test_next_and_previous_walk_the_pipeline():
    assert [next_stage(s) for s in (Q, I, R, E)] == [I, R, E, JobStatus.COMPLETED]
    assert [previous_stage(s) for s in (Q, I, R, E, JobStatus.COMPLETED)] == [None, Q, I, R, E]
    assert STAGES == (I, R, E)
    for status in TERMINAL:
        assert next_stage(status) is None and stage_index(status) == 4
    for ending in ENDINGS:
        assert previous_stage(ending) is None
    assert [stage_index(s) for s in PIPELINE[:-1]] == [0, 1, 2, 3]


def test_the_table_states_exactly_the_moves_the_service_makes():
    assert TRANSITIONS == {
        Q: {I, *ENDINGS},
        I: {I, R, Q, *ENDINGS},  # itself: a redelivery resumes; queued: a retry from init
        R: {R, E, Q, *ENDINGS},
        E: {E, JobStatus.COMPLETED, Q, *ENDINGS},
        **{status: set() for status in TERMINAL},
    }


@pytest.mark.parametrize("source,target", [(JobStatus.COMPLETED, R), (E, I), (Q, R), (I, E), (Q, Q),
                                           (Q, JobStatus.COMPLETED), (R, JobStatus.COMPLETED),
                                           (JobStatus.FAILED, Q)])
def test_forbidden_moves(source, target):
    assert target not in TRANSITIONS[source] and source not in sources_for(target)


def test_sources_are_the_table_read_backwards():
    for target in JobStatus:
        assert sources_for(target) == {s for s, followers in TRANSITIONS.items() if target in followers}
    assert sources_for(Q) == set(STAGES) and sources_for(JobStatus.COMPLETED) == {E}


def test_stage_states_keep_the_stored_values():
    # records already in a running Redis hold these strings
    assert [s.value for s in StageState] == ["", "running", "done", "redispatched"]
    assert StageState("done") is StageState.DONE and not StageState.NONE
