"""The LLM routing on a Redis of its own (``routing_url``, prorl_celery/llm/store.py): every key the
routing writes lands there and none on the head; quotas and weights still come from the head's
project records and the job's project from its record; fair share's 429, the lease keeper, drain
with abort, the session's end and the metrics all read the routing's Redis.

(The whole of tests/llm and the fair share tests also run with the routing apart:
``PRORL_TEST_ROUTING_REDIS=1 pytest tests/llm tests/prorl_celery/test_fairshare.py ...``.)"""
from __future__ import annotations

import time
import uuid

import pytest
import redis

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.errors import OverQuota
from prorl_celery.fairshare import FairShare
from prorl_celery.jobs import JobStore
from prorl_celery.leases import CALL_CHECK_S, Lease
from prorl_celery.llm import BackendSpec
from prorl_celery.llm.pool import LLMPool, end_rollout
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.store import HeadView, llm_in_flight, routing_redis
from prorl_celery.llm.transport import Call
from prorl_celery.models import JobRequest
from prorl_celery.ops.launcher import Stack, StackOptions
from prorl_celery.projects import ProjectStore
from prorl_celery.status import JobStatus
from tests.conftest import wait_until

# Not the unit tier: it starts a Redis of its own (the unit tier allows only the session's).


@pytest.fixture(scope="module")
def routing_url(tmp_path_factory):
    stack = Stack(StackOptions(state_dir=tmp_path_factory.mktemp("routing"), persist=False))
    try:
        yield stack.start_routing_redis()
    finally:
        stack.stop()


@pytest.fixture
def routed(scratch_redis, routing_url, monkeypatch):
    """(head, routing): the head a database no worker reads, the routing's Redis emptied."""
    monkeypatch.setattr(get_settings(), "routing_url", routing_url)
    routing = routing_redis(scratch_redis)
    assert routing is not scratch_redis
    routing.flushdb()
    HeadView.changed()
    yield scratch_redis, routing
    routing.flushdb()
    scratch_redis.flushdb()


def _job(head: redis.Redis, project: str | None) -> str:
    job_id = f"rs-{uuid.uuid4().hex[:10]}"
    JobStore(head).create_many([(job_id, JobRequest(instance={"data_source": "shell"}))], project=project)
    return job_id


def _project(head: redis.Redis, weight: float = 1.0, **quotas) -> str:
    name = f"rsp-{uuid.uuid4().hex[:8]}"
    store = ProjectStore(head)
    store.add(name, weight)
    if quotas:
        store.set_quotas(name, quotas)
    return name


def test_every_routing_key_lands_on_its_own_redis_and_none_on_the_head(routed):
    head, routing = routed
    project = _project(head, max_llm_in_flight=4)
    job = _job(head, project)
    before = set(head.keys("*"))
    pool = LLMPool(head)
    backend, _ = pool.registry.add(BackendSpec(address="http://10.0.8.1:1", capacity=4, probe=False))
    slot = pool.router.acquire(job)
    assert isinstance(slot, Slot) and slot.project == project and slot.lease.redis is routing
    assert routing.sismember(keys.llm_backends(), backend.id)
    assert routing.zscore(keys.llm_inflight(backend.id), slot.lease.token)
    assert routing.zscore(keys.llm_project_inflight(project), slot.lease.token)
    assert routing.zscore(keys.llm_sessions(backend.id), job)
    assert routing.get(keys.llm_sticky(job)) == backend.id.encode()
    assert pool.registry.get(backend.id).in_flight == 1 and llm_in_flight(head, [project]) == [1]
    pool.router.release(slot, "ok", tokens=30)
    pool.router.flush_counts()  # (written by this process within counts.FLUSH_S)
    assert int(routing.hget(keys.llm_backend(backend.id), "served")) == 1
    assert routing.zcard(keys.llm_project_inflight(project)) == 0
    assert sum(int(v) for v in routing.hvals(keys.llm_project_tokens(project))) == 30
    end_rollout(head, job)  # the run stage's end, given the head's client
    assert routing.zcard(keys.llm_sessions(backend.id)) == 0 and not routing.exists(keys.llm_sticky(job))
    assert set(head.keys("*")) == before  # the head wrote nothing for the routing


def test_quotas_and_weights_come_from_the_heads_project_records(routed):
    head, routing = routed
    capped = _project(head, max_llm_in_flight=1)
    job = _job(head, capped)
    pool = LLMPool(head)
    pool.registry.add(BackendSpec(address="http://10.0.8.2:1", capacity=8, probe=False))
    first = pool.router.acquire(job)
    assert isinstance(first, Slot) and pool.router.acquire(job) == "quota"
    ProjectStore(head).set_quotas(capped, {"max_llm_in_flight": 2})  # this process reads it at once
    second = pool.router.acquire(job)
    assert isinstance(second, Slot)
    for slot in (first, second):
        pool.router.release(slot, "aborted")
    # a full pool shared by weight: 1 and 3 over a capacity of 4 (the head's weights, given to the script)
    big, small = _project(head, weight=1), _project(head, weight=3)
    jobs = {p: _job(head, p) for p in (big, small)}
    pool.registry.clear()
    pool.registry.add(BackendSpec(address="http://10.0.8.3:1", capacity=4, probe=False))
    mine = [pool.router.acquire(jobs[big]) for _ in range(6)]  # alone: it queues past the capacity
    theirs = [pool.router.acquire(jobs[small]) for _ in range(3)]
    assert all(isinstance(s, Slot) for s in mine + theirs)
    assert pool.router.acquire(jobs[small]) == "share" and pool.router.acquire(jobs[big]) == "share"
    for slot in mine + theirs:
        pool.router.release(slot, "aborted")


def test_fair_share_refuses_at_the_llm_quota_counted_on_the_routing_redis(routed):
    head, routing = routed
    project = _project(head, max_llm_in_flight=1, tokens_per_hour=100,
                       over={"max_llm_in_flight": "429", "tokens_per_hour": "429"})
    fair = FairShare(head)
    assert fair.routing is routing
    assert fair.enqueue(project, [("rs-a", 0)]) == 1
    now_ms = int(time.time() * 1000)
    routing.zadd(keys.llm_project_inflight(project), {"t": now_ms + 30_000})
    with pytest.raises(OverQuota) as refused:
        fair.enqueue(project, [("rs-b", 0)])
    assert refused.value.quota == "max_llm_in_flight"
    routing.zadd(keys.llm_project_inflight(project), {"t": now_ms - 1})  # lapsed: counts no more
    routing.hset(keys.llm_project_tokens(project), int(time.time() // 60), 150)
    with pytest.raises(OverQuota) as refused:
        fair.enqueue(project, [("rs-b", 0)])
    assert refused.value.quota == "tokens_per_hour" and 1 <= refused.value.retry_after <= 3600
    assert head.hlen(keys.llm_project_tokens(project)) == 0


def test_one_keeper_renews_each_lease_on_its_own_redis_and_a_drain_withdraws_the_call(routed):
    from prorl_celery.llm.control import drain

    head, routing = routed
    pool = LLMPool(head)
    backend, _ = pool.registry.add(BackendSpec(address="http://10.0.8.4:1", capacity=4, probe=False))
    stage = Lease(head, f"prorl:test:stage:{uuid.uuid4().hex}", 1.2)
    assert stage.acquire()
    slot = pool.router.acquire(_job(head, None), lease_s=1.2)
    try:
        with Call(30, lease=slot.lease) as call:
            time.sleep(1.6)  # past both expiries: the keeper renewed each on its own Redis
            assert head.get(stage.key) == stage.token.encode()
            assert routing.zscore(slot.lease.key, slot.lease.token) > time.time() * 1000
            assert not head.exists(slot.lease.key)
            result = drain(pool.registry, [backend.id], wait_s=0.2, abort=True)
            assert result["aborted"] == {backend.id: 1}
            wait_until(lambda: call.reason is not None, CALL_CHECK_S * 6, "the withdrawn call's abort")
            assert call.reason == "lost"
    finally:
        stage.release()
        pool.router.release(slot, "aborted")


def test_the_metrics_count_a_projects_llm_requests_on_the_routing_redis(routed):
    from prometheus_client import CollectorRegistry, generate_latest

    from prorl_celery.metrics import ServiceCollector

    head, routing = routed
    project = _project(head)
    routing.zadd(keys.llm_project_inflight(project), {"a": time.time() * 1000 + 30_000,
                                                      "b": time.time() * 1000 + 30_000})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(JobStore(head)))
    assert f'prorl_project_llm_in_flight{{project="{project}"}} 2.0' in generate_latest(registry).decode()


@pytest.mark.unit
def test_the_head_view_remembers_a_stored_jobs_project_and_rereads_projects(scratch_redis, monkeypatch):
    """Pure caching, on the session's Redis: a stored job's project is read once (an unknown job
    not remembered: it may be stored later); the projects again after PROJECTS_TTL_S, or at once
    after this process changed one."""
    from prorl_celery.llm import store as routing_store

    HeadView.changed()
    view = HeadView(scratch_redis)
    project = _project(scratch_redis, weight=2)
    job = f"rs-{uuid.uuid4().hex[:10]}"
    assert view.project_of(job) == ""
    JobStore(scratch_redis).create_many([(job, JobRequest(instance={"data_source": "shell"}))], project=project)
    assert view.project_of(job) == project
    scratch_redis.hset(keys.job(job), "project", "someone-else")
    assert view.project_of(job) == project  # remembered: a job's project never changes
    records, weights = view.projects()
    assert project in records and f'"{project}": 2.0' in weights
    other = f"rsp-{uuid.uuid4().hex[:8]}"
    scratch_redis.hset(keys.projects(), other, '{"weight": 5}')  # another process's write
    assert other not in view.projects()[0]
    monkeypatch.setattr(routing_store, "PROJECTS_TTL_S", 0.0)
    assert other in view.projects()[0]
    monkeypatch.setattr(routing_store, "PROJECTS_TTL_S", 60.0)
    ProjectStore(scratch_redis).set_weight(other, 7)  # this process's write: read again at once
    assert '"weight": 7.0' in view.projects()[0][other]
    JobStore(scratch_redis).transition(job, JobStatus.CANCELLED)


def test_healthz_names_the_routings_redis_and_the_registry_answers_from_it(routed, monkeypatch):
    """``/healthz`` says whether the routing's Redis answers; ``GET /llm_servers`` lists what it holds."""
    from flask_api import create_app

    head, routing = routed
    client = create_app({"TESTING": True}).test_client()
    headers = {"Authorization": f"Bearer {get_settings().api_token}"}
    assert client.get("/healthz").get_json()["routing"] == "ok"
    backend, _ = LLMPool(head).registry.add(BackendSpec(address="http://10.0.8.5:1", capacity=2, probe=False))
    listed = client.get("/llm_servers", headers=headers).get_json()
    assert backend.id in str(listed)
    monkeypatch.setattr(get_settings(), "routing_url", "")
    assert client.get("/healthz").get_json()["routing"] is None
