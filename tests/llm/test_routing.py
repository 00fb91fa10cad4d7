"""Registry and selection in Redis: load relative to capacity, ties, stickiness, lease expiry."""
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

from prorl_celery.errors import InvalidRequest, UnknownBackend
from prorl_celery.llm import BackendSpec, BackendStatus
from prorl_celery.llm.routing import Slot
from tests.llm.conftest import add, eventually


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


def test_least_in_flight_relative_to_capacity(pool):
    small = add(pool, "http://10.0.0.1:1", capacity=2)
    big = add(pool, "http://10.0.0.2:1", capacity=8)
    slots = [pool.router.acquire(f"job-{i}") for i in range(10)]
    counts = collections.Counter(s.backend_id for s in slots)
    assert counts == {small: 2, big: 8}
    assert pool.registry.get(small).in_flight == 2 and pool.registry.get(big).in_flight == 8
    for slot in slots:
        pool.router.release(slot, "ok")
    assert [b.in_flight for b in pool.registry.list()] == [0, 0]
    assert sum(b.served for b in pool.registry.list()) == 10


def test_ties_spread_over_backends(pool):
    ids = {add(pool, f"http://10.0.0.{i}:1", capacity=4) for i in range(4)}
    held = [pool.router.acquire(None) for _ in range(4)]
    assert {s.backend_id for s in held} == ids  # least loaded: one each
    for slot in held:
        pool.router.release(slot, "ok")
    used = collections.Counter()
    for _ in range(80):  # all idle: a random one of the tied backends each time
        slot = pool.router.acquire(None)
        used[slot.backend_id] += 1
        pool.router.release(slot, "ok")
    assert set(used) == ids and min(used.values()) >= 5


def test_sticky_per_job_unless_overloaded(pool):
    a = add(pool, "http://10.0.0.1:1", capacity=4)
    b = add(pool, "http://10.0.0.2:1", capacity=4)
    job = f"rollout-{uuid.uuid4().hex}"
    first = pool.router.acquire(job)
    pool.router.release(first, "ok")
    for _ in range(20):  # equal loads: always back to the backend of the previous turn
        slot = pool.router.acquire(job)
        assert slot.backend_id == first.backend_id
        pool.router.release(slot, "ok")
    sticky, other = (a, b) if first.backend_id == a else (b, a)

    def load(backend_id: str, n: int) -> list[Slot]:
        """n leases on ``backend_id`` (the other backend drains meanwhile)."""
        away = other if backend_id == sticky else sticky
        pool.registry.set_status(away, BackendStatus.DRAINING, [BackendStatus.ACTIVE])
        slots = [pool.router.acquire(f"filler-{uuid.uuid4().hex}") for _ in range(n)]
        pool.registry.set_status(away, BackendStatus.ACTIVE, [BackendStatus.DRAINING])
        assert {s.backend_id for s in slots} == {backend_id}
        return slots

    held = load(sticky, 1)  # 1/4 vs 0/4: a little busier is not overloaded
    slot = pool.router.acquire(job)
    assert slot.backend_id == sticky
    pool.router.release(slot, "ok")
    held += load(sticky, 2)  # 3/4 vs 0/4: overloaded, the rollout spills to the other one
    moved = pool.router.acquire(job)
    assert moved.backend_id == other
    pool.router.release(moved, "ok")
    for slot in held:
        pool.router.release(slot, "ok")
    again = pool.router.acquire(job)  # and sticks to where it moved
    assert again.backend_id == other


def test_expired_lease_stops_counting(pool):
    bid = add(pool, "http://10.0.0.1:1", capacity=1)
    slot = pool.router.acquire("crashed", lease_s=0.3)  # never released, never renewed
    assert isinstance(slot, Slot) and pool.registry.get(bid).in_flight == 1
    eventually(lambda: pool.registry.get(bid).in_flight == 0, 3, "the lease to lapse")
    assert pool.router.acquire("next").backend_id == bid


def test_killed_worker_requests_stop_counting(pool, fake_llms, redis_url):
    """A worker killed with -9 mid-request: its lease lapses and the server sees the disconnect."""
    (slow,) = fake_llms(1, latency="step_s=0.5,capacity=4")
    bid = add(pool, slow)
    code = textwrap.dedent("""
        from prorl_celery.llm import LLMPool, LLMRequest, SamplingParams
        LLMPool().generate("doomed", LLMRequest(messages=[{"role": "user", "content": "x" * 40}],
                           sampling=SamplingParams(max_tokens=60)))
    """)
    env = {**os.environ, "PRORL_REDIS_URL": redis_url, "PRORL_LLM_LEASE_S": "1.5"}
    worker = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        eventually(lambda: pool.registry.get(bid).in_flight == 1, 15, "the request to be in flight")
        eventually(lambda: slow.stats()["running"] == 1, 5, "the server to run it")
        time.sleep(1.0)  # the live worker renews its lease past the first expiry
        assert pool.registry.get(bid).in_flight == 1
        worker.send_signal(signal.SIGKILL)
        worker.wait(5)
        eventually(lambda: slow.stats()["aborted"] == 1, 5, "the server to see the disconnect")
        eventually(lambda: pool.registry.get(bid).in_flight == 0, 5, "the dead worker's lease to lapse")
    finally:
        worker.kill()
    assert pool.registry.get(bid).served == 0
