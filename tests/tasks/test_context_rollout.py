"""A stage's transcript against a real Redis, without Celery: saved with the stage's state in one
fenced step, resumed by a redelivery, flushed when a stage ends, and read back by the result."""
from __future__ import annotations

import uuid

import pytest

from prorl_celery.errors import JobCancelled
from prorl_celery.jobs import JobStore
from prorl_celery.models import JobRequest
from prorl_celery.status import JobStatus, StageState
from prorl_celery.rollout.trajectory import flatten
from prorl_celery.rollout.views import expand_result
from tasks.context import StageContext
from tasks.handlers.math import MathHandler
from tests.prorl_celery.test_rollouts import _exact_turns

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)


@pytest.fixture
def redis_client(scratch_redis):
    """Jobs put in a running stage by hand live where no sweep ends them (tests/unit_tier.py)."""
    return scratch_redis


def _in_run(store: JobStore) -> str:
    job_id = uuid.uuid4().hex
    store.create_many([(job_id, JobRequest(instance={"data_source": "math"}))])
    for step in (JobStatus.INIT, JobStatus.RUN):
        assert store.transition(job_id, step, stage_state=StageState.RUNNING)[0]
    return job_id


def _stage(store: JobStore, job_id: str) -> StageContext:
    return StageContext(store, store.get(job_id), JobStatus.RUN, budget_s=60.0)


def test_a_redelivered_stage_resumes_the_saved_transcript_and_the_result_reads_it(redis_client):
    store = JobStore(redis_client, job_ttl_s=60)
    job_id = _in_run(store)
    turns = _exact_turns(3)
    first = _stage(store, job_id)
    first.transcript.messages.append({"role": "user", "content": "go"})
    first.transcript.add(turns[0])
    first.transcript.messages.append(turns[0].message)
    first.save()
    first.transcript.add(turns[1])  # never saved: the worker died here

    again = _stage(store, job_id)
    assert again.transcript.turns() == turns[:1] and again.transcript.last == turns[0]
    for turn in turns[1:]:
        again.transcript.add(turn)
        again.transcript.messages.append(turn.message)
    again.flush()  # what a stage's end (or its failure) does with the turns not saved yet
    fields = MathHandler().result_fields(store.get(job_id).state)
    assert fields["turns"] == 3 and "messages" not in fields and "tokens" not in fields
    out = expand_result(redis_client, {"job_id": job_id, **fields})
    assert (out["tokens"], out["token_mode"]) == flatten(turns)
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "assistant", "assistant"]


def test_a_save_after_the_job_ended_writes_nothing(redis_client):
    store = JobStore(redis_client, job_ttl_s=60)
    job_id = _in_run(store)
    ctx = _stage(store, job_id)
    ctx.transcript.add(_exact_turns(1)[0])
    assert store.transition(job_id, JobStatus.CANCELLED)[0]
    try:
        ctx.save()
    except JobCancelled:
        pass
    else:
        raise AssertionError("the save of an ended job went through")
    assert _stage(store, job_id).transcript.calls == 0 and "_rollout" not in ctx.state
