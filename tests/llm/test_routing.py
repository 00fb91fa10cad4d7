"""Registry and selection in Redis: load relative to capacity, ties, measured speed, session
affinity and its end, lease expiry."""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.errors import InvalidRequest, UnknownBackend
from prorl_celery.llm import BackendSpec, BackendStatus
from prorl_celery.llm.routing import Slot
from tests.llm.conftest import add, eventually, project_jobs, weighted_projects


@pytest.mark.unit
def test_same_address_is_one_backend(pool):
    first, created = pool.registry.add(BackendSpec(address="http://10.0.0.1:8000/v1", capacity=8))
    again, created_again = pool.registry.add(BackendSpec(address="10.0.0.1:8000/", weight_version="v2"))
    assert created and not created_again and first.id == again.id
    assert [b.id for b in pool.registry.list()] == [first.id]
    assert again.capacity == 8 and again.weight_version == "v2"  # an update keeps what it does not set
    with pytest.raises(InvalidRequest) as err:
        pool.registry.add(BackendSpec(address="ftp://x:1"))
    assert err.value.field == "address"
    with pytest.raises(UnknownBackend):
        pool.registry.remove("llm-nope")


@pytest.mark.unit
def test_a_slot_holds_the_backend_record_as_the_registry_reads_it(pool):
    spec = BackendSpec(address="http://10.0.0.9:1", capacity=3, model="m", weight_version="v7",
                       max_model_len=4096, tokenizer="byte", api_key="sekret", logprobs_mode="raw_logprobs",
                       protocol="generate", dialect="sglang", probe=False)
    backend, _ = pool.registry.add(spec)
    slot = pool.router.acquire("job-record")
    assert slot.backend == pool.registry.get(backend.id)  # every field, in flight counting this one
    assert slot.backend.in_flight == 1 and slot.load == 0
    assert slot.api_key == "sekret" and "sekret" not in str(slot.backend.public())
    pool.router.release(slot, "aborted")


@pytest.mark.unit
def test_least_in_flight_relative_to_capacity(pool):
    small = add(pool, "http://10.0.0.1:1", capacity=2)
    big = add(pool, "http://10.0.0.2:1", capacity=8)
    slots = [pool.router.acquire(f"job-{i}") for i in range(10)]
    counts = collections.Counter(s.backend.id for s in slots)
    assert counts == {small: 2, big: 8}
    assert pool.registry.get(small).in_flight == 2 and pool.registry.get(big).in_flight == 8
    for slot in slots:
        pool.router.release(slot, "ok")
    assert [b.in_flight for b in pool.registry.list()] == [0, 0]
    pool.router.flush_counts()  # (written by this process within counts.FLUSH_S)
    assert sum(b.served for b in pool.registry.list()) == 10


@pytest.mark.unit
def test_ties_spread_over_backends(pool):
    ids = {add(pool, f"http://10.0.0.{i}:1", capacity=4) for i in range(4)}
    held = [pool.router.acquire(None) for _ in range(4)]
    assert {s.backend.id for s in held} == ids  # least loaded: one each
    for slot in held:
        pool.router.release(slot, "aborted")  # not "ok": no latency measured, so still alike
    used = collections.Counter()
    for _ in range(80):  # all idle and unmeasured: a random one of the tied backends each time
        slot = pool.router.acquire(None)
        used[slot.backend.id] += 1
        pool.router.release(slot, "aborted")
    assert set(used) == ids and min(used.values()) >= 5


@pytest.mark.unit
def test_measured_faster_backend_gets_the_new_rollouts(pool):
    fast = add(pool, "http://10.0.0.1:1", capacity=8)
    slow = add(pool, "http://10.0.0.2:1", capacity=8)
    pool.registry.set_fields(fast, turn_s=0.1)
    pool.registry.set_fields(slow, turn_s=0.4)  # seconds per turn per session, as releases measure
    slots = [pool.router.acquire(f"new-{uuid.uuid4().hex}") for _ in range(10)]
    counts = collections.Counter(s.backend.id for s in slots)
    # (n + 1) x 0.1 <= 0.4 while n <= 3, then the slow one takes one per four of the fast one's
    assert counts == {fast: 8, slow: 2}, counts
    for slot in slots:
        pool.router.release(slot, "aborted")


@pytest.mark.unit
def test_release_measures_seconds_per_turn_per_session(pool):
    bid = add(pool, "http://10.0.0.1:1", capacity=8)
    others = [pool.router.acquire(f"other-{uuid.uuid4().hex}") for _ in range(3)]
    slot = pool.router.acquire(f"job-{uuid.uuid4().hex}")
    assert slot.load == 3  # three other sessions on it when chosen
    time.sleep(0.4)
    pool.router.release(slot, "ok")
    pool.router.flush_counts()
    turn_s = float(pool.router.redis.hget(keys.llm_backend(bid), "turn_s"))
    assert 0.1 <= turn_s < 0.2, turn_s  # 0.4 s over 4 sessions
    for other in others:
        pool.router.release(other, "failed")  # a failure measures nothing (and is written at once)
    assert float(pool.router.redis.hget(keys.llm_backend(bid), "turn_s")) == turn_s


@pytest.mark.unit
def test_sticky_per_job_until_its_queue_costs_more_than_a_reprefill(pool):
    a = add(pool, "http://10.0.0.1:1", capacity=4)
    b = add(pool, "http://10.0.0.2:1", capacity=4)
    for bid in (a, b):
        pool.registry.set_fields(bid, turn_s=0.1)
    job = f"rollout-{uuid.uuid4().hex}"
    first = pool.router.acquire(job)
    pool.router.release(first, "aborted")
    for _ in range(20):  # equal loads: always back to the backend of the previous turn
        slot = pool.router.acquire(job)
        assert slot.backend.id == first.backend.id
        pool.router.release(slot, "aborted")
    sticky, other = (a, b) if first.backend.id == a else (b, a)

    def load(n: int) -> list[Slot]:
        """n more leases on the sticky backend (the other one drains meanwhile)."""
        pool.registry.set_status(other, BackendStatus.DRAINING, [BackendStatus.ACTIVE])
        slots = [pool.router.acquire(None) for _ in range(n)]
        pool.registry.set_status(other, BackendStatus.ACTIVE, [BackendStatus.DRAINING])
        assert {s.backend.id for s in slots} == {sticky}
        return slots

    # a turn queued behind q requests waits about q turns; re-prefilling elsewhere costs
    # llm_sticky_reprefill_turns turns of the other backend, which is as fast
    reprefill = get_settings().llm_sticky_reprefill_turns
    full = int(4 + reprefill - 1)  # in flight at which the job's turn queues exactly `reprefill` deep
    held = load(3)  # 3/4 against an idle 0/4: its batch still has a slot, so it stays
    slot = pool.router.acquire(job)
    assert slot.backend.id == sticky
    pool.router.release(slot, "aborted")
    held += load(full - 3)
    slot = pool.router.acquire(job)  # queued as deep as a re-prefill costs: still not worth moving
    assert slot.backend.id == sticky
    pool.router.release(slot, "aborted")
    held += load(1)
    moved = pool.router.acquire(job)  # one deeper: it moves, and leaves its session behind
    assert moved.backend.id == other
    assert pool.router.redis.zscore(keys.llm_sessions(sticky), job) is None
    pool.router.release(moved, "aborted")
    for slot in held:
        pool.router.release(slot, "aborted")
    again = pool.router.acquire(job)  # and sticks to where it moved
    assert again.backend.id == other


@pytest.mark.unit
def test_ended_rollout_frees_its_session(pool):
    a = add(pool, "http://10.0.0.1:1", capacity=1)
    b = add(pool, "http://10.0.0.2:1", capacity=1)
    one, two, three = (f"{n}-{uuid.uuid4().hex}" for n in ("one", "two", "three"))
    first = pool.router.acquire(one)
    pool.router.release(first, "aborted")
    second = pool.router.acquire(two)  # "one" is a session of the first backend: the other is free
    assert {first.backend.id, second.backend.id} == {a, b}
    pool.router.release(second, "aborted")
    pool.end_rollout(one)
    assert pool.router.redis.zcard(keys.llm_sessions(first.backend.id)) == 0
    assert pool.router.redis.get(keys.llm_sticky(one)) is None
    third = pool.router.acquire(three)  # the room "one" held is free again
    assert third.backend.id == first.backend.id


@pytest.mark.unit
def test_expired_lease_stops_counting(pool):
    bid = add(pool, "http://10.0.0.1:1", capacity=1)
    slot = pool.router.acquire("crashed", lease_s=0.3)  # never released, never renewed
    assert isinstance(slot, Slot) and pool.registry.get(bid).in_flight == 1
    eventually(lambda: pool.registry.get(bid).in_flight == 0, 3, "the lease to lapse")
    assert pool.router.acquire("next").backend.id == bid


def test_killed_worker_requests_stop_counting(pool, fake_llms, redis_url):
    """A worker killed with -9 mid-request: its lease lapses and the server sees the disconnect."""
    (slow,) = fake_llms(1, latency="step_s=0.5,capacity=4")
    bid = add(pool, slow)
    code = textwrap.dedent("""
        from prorl_celery.llm import LLMPool, LLMRequest, SamplingParams
        LLMPool().generate("doomed", LLMRequest(messages=[{"role": "user", "content": "x" * 40}],
                           sampling=SamplingParams(max_tokens=60)))
    """)
    # a 3 s lease, renewed every 1 s: the live worker keeps it through a 2 s stall of a loaded machine
    env = {**os.environ, "PRORL_REDIS_URL": redis_url, "PRORL_LLM_LEASE_S": "3"}
    worker = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        eventually(lambda: pool.registry.get(bid).in_flight == 1, 15, "the request to be in flight")
        eventually(lambda: slow.stats()["running"] == 1, 5, "the server to run it")
        time.sleep(3.5)  # the live worker renews its lease past the first expiry
        assert pool.registry.get(bid).in_flight == 1
        worker.send_signal(signal.SIGKILL)
        worker.wait(5)
        eventually(lambda: slow.stats()["aborted"] == 1, 5, "the server to see the disconnect")
        eventually(lambda: pool.registry.get(bid).in_flight == 0, 10, "the dead worker's lease to lapse")
    finally:
        worker.kill()
    assert pool.registry.get(bid).served == 0


@pytest.mark.unit
def test_a_private_backend_serves_only_its_projects_jobs(pool):
    """A backend a project registered is a candidate only for that project's jobs (the router reads
    the job's project in its script); shared ones serve every job, the operator's jobs included."""
    with project_jobs(pool, ("pa", "pb", None)) as jobs:
        private, _ = pool.registry.add(BackendSpec(address="http://10.0.5.1:1", capacity=64, probe=False), project="pa")
        assert pool.router.acquire(jobs["pb"]) == "none" and pool.router.acquire(jobs[None]) == "none"
        slots = [pool.router.acquire(jobs["pa"]) for _ in range(3)]
        assert {s.backend.id for s in slots} == {private.id} and slots[0].backend.project == "pa"
        shared = add(pool, "http://10.0.5.2:1", capacity=1)
        others = [pool.router.acquire(jobs[owner]) for owner in ("pb", None) for _ in range(4)]
        assert {s.backend.id for s in others} == {shared}  # past its capacity, never onto pa's idle one
        for slot in slots + others:
            pool.router.release(slot, "ok")


@pytest.mark.unit
def test_a_projects_llm_quotas_hold_its_calls(pool):
    """``max_llm_in_flight``: a project's call past it gets no slot ('quota': the pool waits) until
    one of its calls is released; ``tokens_per_hour``: released calls' tokens fill its hour, and at
    the quota its next call waits too. Another project's calls are not held."""
    from prorl_celery.jobs import JobStore
    from prorl_celery.models import JobRequest
    from prorl_celery.projects import ProjectStore
    from prorl_celery.status import JobStatus

    tag = uuid.uuid4().hex[:8]
    capped, free = f"llmq-{tag}", f"llmf-{tag}"
    projects = ProjectStore(pool.redis)
    for name in (capped, free):
        projects.add(name)
    projects.set_quotas(capped, {"max_llm_in_flight": 2, "tokens_per_hour": 100})
    store = JobStore(pool.redis)
    jobs = {p: f"route-{p}" for p in (capped, free)}
    for project, job_id in jobs.items():
        store.create_many([(job_id, JobRequest(instance={"data_source": "shell"}))], project=project)
    try:
        add(pool, "http://10.0.6.1:1", capacity=64)
        held = [pool.router.acquire(jobs[capped]) for _ in range(2)]
        assert all(isinstance(s, Slot) and s.project == capped for s in held)
        assert pool.router.acquire(jobs[capped]) == "quota"
        other = pool.router.acquire(jobs[free])
        assert isinstance(other, Slot)
        pool.router.release(held[0], "ok", tokens=60)
        third = pool.router.acquire(jobs[capped])
        assert isinstance(third, Slot)
        pool.router.release(held[1], "ok", tokens=60)  # 120 tokens this hour: over 100
        pool.router.release(third, "aborted")
        assert pool.router.acquire(jobs[capped]) == "quota"
        pool.router.release(other, "ok", tokens=10_000)
        assert isinstance(again := pool.router.acquire(jobs[free]), Slot)
        pool.router.release(again, "aborted")
    finally:
        for job_id in jobs.values():
            store.transition(job_id, JobStatus.CANCELLED)


@pytest.mark.unit
def test_a_full_pool_is_shared_by_weight(pool):
    """Every slot taken: a project alone still queues in a backend (nothing idles), but once another
    project has calls in flight, the one holding its weight's share of the capacity waits
    ('share') while the other's calls go in; a free slot goes to whoever asks."""
    names = weighted_projects(pool, "sh", big=1, small=3)
    big, small = names["big"], names["small"]
    with project_jobs(pool, (big, small)) as jobs:
        add(pool, "http://10.0.7.1:1", capacity=4)
        mine = [pool.router.acquire(jobs[big]) for _ in range(6)]  # alone: past the capacity too
        assert all(isinstance(s, Slot) for s in mine)
        theirs = [pool.router.acquire(jobs[small]) for _ in range(3)]  # share 3 of 4: under it, all go in
        assert all(isinstance(s, Slot) for s in theirs)
        assert pool.router.acquire(jobs[small]) == "share" and pool.router.acquire(jobs[big]) == "share"
        for slot in mine[:5]:
            pool.router.release(slot, "ok")
        assert pool.router.acquire(jobs[big]) == "share"  # 1 + 3 in flight: full, and its share is 1
        pool.router.release(mine[5], "ok")
        again = pool.router.acquire(jobs[big])  # a free slot: taken by whoever asks
        assert isinstance(again, Slot)
        for slot in [*theirs, again]:
            pool.router.release(slot, "ok")
