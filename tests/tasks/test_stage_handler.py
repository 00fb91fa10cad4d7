"""A stage looks its job's handler up once and passes it down to the failure path and the result
(tasks/stages.py, tasks/outcome.py): run in this process on the real job store."""
from __future__ import annotations

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
