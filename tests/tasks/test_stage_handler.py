"""A stage looks its job's handler up once and passes it down to the failure path and the result
(tasks/stages.py, tasks/outcome.py): run in this process on the real job store."""
from __future__ import annotations

import threading
import time
import uuid

import pytest

import tasks.handlers
from prorl_celery.connections import get_store
from prorl_celery.models import JobRequest
from prorl_celery.status import JobStatus, StageState
from tasks import stages

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)


def job_running_init(store, data_source: str = "shell") -> str:
    """A job stored and put in a running init by hand: never sent, so no worker runs it."""
    job_id = f"by-hand-{uuid.uuid4().hex[:8]}"
    request = JobRequest(instance={"data_source": data_source, "commands": ["true"]})
    assert store.create_many([(job_id, request)]) == [True]
    ok, _ = store.transition(job_id, JobStatus.INIT, stage_state=StageState.RUNNING, t_stage_start=time.time())
    assert ok
    return job_id


@pytest.fixture
def lookups(monkeypatch) -> list[str]:
    """Every get_handler call of this process, whoever makes it."""
    calls: list[str] = []
    real = tasks.handlers.get_handler

    def counting(data_source: str):
        calls.append(data_source)
        return real(data_source)

    monkeypatch.setattr(tasks.handlers, "get_handler", counting)
    monkeypatch.setattr(stages, "get_handler", counting)
    return calls


def test_a_failing_stage_looks_its_handler_up_once_and_its_result_has_the_handlers_fields(redis_url, lookups):
    store = get_store()
    source = "tests.handlers_for_tests:FailingInitHandler"
    job_id = job_running_init(store, source)
    out = stages._execute(store, store.get(job_id), JobStatus.INIT, resumed=False)
    assert out["status"] == "failed" and out["critical_error"] == "init"
    assert out["error"]["type"] == "RuntimeError" and out["seen"] == "before the crash"
    assert lookups == [source]


def test_a_handler_that_no_longer_loads_ends_the_job_failed_after_one_look_up(redis_url, lookups):
    store = get_store()
    source = "tests.handlers_for_tests:GoneSinceSubmission"
    job_id = job_running_init(store, source)
    out = stages._execute(store, store.get(job_id), JobStatus.INIT, resumed=False)
    assert out["status"] == "failed" and out["error"]["type"] == "unknown_plugin"
    assert "GoneSinceSubmission" in out["error"]["message"]
    assert lookups == [source]


class Sends(list):
    """What this thread's Redis connections sent (another test's background reader may be
    waiting on the same Redis), one entry per send (a command or a pipeline: one round trip
    each): the first command's name and its first key or argument."""

    def since(self, mark: int) -> list[str]:
        return self[mark:]


@pytest.fixture
def sends(monkeypatch) -> Sends:
    import redis.connection

    sent, me = Sends(), threading.get_ident()
    real = redis.connection.AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):
        if threading.get_ident() != me:
            return real(self, command, check_health)
        data = b"".join(command) if isinstance(command, list) else command
        words = [w for w in data.split(b"\r\n") if w and not w.startswith((b"*", b"$"))]
        sent.append(b" ".join(words[:2]).decode(errors="replace")[:60])
        return real(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    return sent


def _past_init_with_a_session(scratch_redis, monkeypatch, prefix: str, backend: str):
    """A gate job (it passes every stage) through init on the stage path, with an LLM session on
    ``backend`` as the router leaves one: (store, job id, task)."""
    from types import SimpleNamespace

    from prorl_celery import keys
    from prorl_celery.jobs import JobStore

    store = JobStore(scratch_redis, job_ttl_s=60)
    monkeypatch.setattr(stages, "get_store", lambda: store)
    job_id = f"{prefix}-{uuid.uuid4().hex[:8]}"
    assert store.create_many([(job_id, JobRequest(instance={"data_source": "tests.handlers_for_tests:GateHandler",
                                                            "gate": "/"}))]) == [True]
    task = SimpleNamespace(request=SimpleNamespace(hostname="here", chain=None))
    assert stages.run_stage(task, JobStatus.INIT, job_id)["stage_done"] == "init"
    scratch_redis.set(keys.llm_sticky(job_id), backend)
    scratch_redis.zadd(keys.llm_sessions(backend), {job_id: 1})
    return store, job_id, task


def test_run_and_eval_take_two_round_trips_each_and_keep_what_they_recorded(scratch_redis, monkeypatch, sends):
    """Each stage: the record read with the running change (and the lease) in one script, then
    one pipeline. The run's:
    the histogram, the done change releasing the lease, the LLM session's end. Eval's: the
    histogram, the terminal change releasing the lease, the totals; no cost read for a job whose
    state saved no call: its cost is still in its result and its project's totals."""
    from prorl_celery import keys
    from prorl_celery.llm import routing
    from prorl_celery.rollout.cost import OPERATOR, totals

    # the run's LLM session (as the router left it) ends with the run's done change
    store, job_id, task = _past_init_with_a_session(scratch_redis, monkeypatch, "eval", "b1")
    scratch_redis.script_load(routing._END)  # as a router that ran before has left it (else loaded once more)
    before = len(sends)
    assert stages.run_stage(task, JobStatus.RUN, job_id)["stage_done"] == "run"
    assert len(sends.since(before)) == 2, sends.since(before)
    assert scratch_redis.get(keys.llm_sticky(job_id)) is None and scratch_redis.zcard(keys.llm_sessions("b1")) == 0
    before = len(sends)
    out = stages.run_stage(task, JobStatus.EVAL, job_id)
    assert len(sends.since(before)) == 2, sends.since(before)
    assert out["status"] == "completed" and out["reward"] == 1.0
    assert out["cost"]["llm_calls"] == 0 and out["cost"]["wall_s"]["eval"] >= 0
    assert scratch_redis.get(keys.stage_lease(job_id)) is None
    assert totals(scratch_redis)[OPERATOR]["jobs"] == 1
    histogram = scratch_redis.hget(keys.stage_histogram("eval"), "count")
    assert histogram == b"1"
    assert store.get(job_id).result["cost"] == out["cost"]


@pytest.mark.parametrize("lost_scripts", [False, True])
def test_a_jobs_cost_reaches_its_projects_totals_once_however_many_try_to_end_it(scratch_redis, lost_scripts):
    """Two ends of one job (a duplicate eval, a cancel racing it): the one whose change ended the
    job counts its cost, the other nothing; also on a Redis that lost its scripts."""
    from prorl_celery import keys
    from prorl_celery.jobs import JobStore
    from prorl_celery.rollout.cost import END_TOKEN, totals
    from tasks.outcome import finish

    store = JobStore(scratch_redis, job_ttl_s=60)
    project = f"p-{uuid.uuid4().hex[:6]}"
    job_id = f"twice-{uuid.uuid4().hex[:8]}"
    assert store.create_many([(job_id, JobRequest(instance={"data_source": "shell"}))], project=project) == [True]
    for stage in (JobStatus.INIT, JobStatus.RUN, JobStatus.EVAL):
        assert store.transition(job_id, stage, stage_state=StageState.RUNNING)[0]
    first, second = store.get(job_id), store.get(job_id)
    if lost_scripts:
        scratch_redis.script_flush()
    done = finish(store, first, JobStatus.COMPLETED, fields={"reward": 1.0}, expect_attempt=1)
    assert done is not None and done.status is JobStatus.COMPLETED
    assert finish(store, second, JobStatus.CANCELLED, fields={}) is None
    assert totals(scratch_redis)[project]["jobs"] == 1
    assert scratch_redis.hget(keys.job(job_id), END_TOKEN) is None
    assert store.get(job_id).result["cost"]["llm_calls"] == 0


def test_the_runs_session_ends_with_its_done_change_also_on_a_redis_that_lost_its_scripts(scratch_redis,
                                                                                          monkeypatch):
    from prorl_celery import keys

    store, job_id, task = _past_init_with_a_session(scratch_redis, monkeypatch, "lost", "b2")
    scratch_redis.script_flush()
    assert stages.run_stage(task, JobStatus.RUN, job_id)["stage_done"] == "run"
    assert scratch_redis.get(keys.llm_sticky(job_id)) is None and scratch_redis.zcard(keys.llm_sessions("b2")) == 0
    assert store.get(job_id).stage_state is StageState.DONE and scratch_redis.get(keys.stage_lease(job_id)) is None
