"""The routing's cost per call does not grow with the backends registered (issue 37): a rollout
whose backend has a free slot reads that backend alone, a new one a few random ones above
``routing.SCAN_ALL`` (all of them only when none of those may serve it), and the choice is the one
the scan of every backend makes; the counters a release no longer writes arrive all the same."""
from __future__ import annotations

import random
import time
import uuid

import pytest

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.llm import BackendSpec, counts, routing
from prorl_celery.llm.models import Protocol
from prorl_celery.llm.routing import Slot
from tests.llm.conftest import project_jobs, weighted_projects


def _hash_reads(client) -> int:
    """Backend hashes read so far by the routing's Redis (``HMGET`` and ``HGETALL`` calls)."""
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("hmget", "hgetall"))


def _register(pool, n: int, start: int = 0, project: str | None = None, **spec) -> list[str]:
    """``n`` backends (``project``'s own, else shared), as the registry writes them."""
    return [pool.registry.add(BackendSpec(address=f"http://10.1.{(start + i) // 250}.{(start + i) % 250 + 1}:1",
                                          probe=False, **spec), project=project)[0].id for i in range(n)]


@pytest.mark.unit
def test_an_acquire_reads_one_backend_for_a_rollout_that_has_one_and_a_few_for_a_new_one(pool):
    _register(pool, 200, capacity=4)
    routing_redis, job = pool.router.redis, f"scale-{uuid.uuid4().hex}"
    before = _hash_reads(routing_redis)
    first = pool.router.acquire(job)
    # the sticky backend (none yet) and SAMPLE random ones, and the chosen one's record for this process's copy
    assert isinstance(first, Slot) and _hash_reads(routing_redis) - before <= routing.SAMPLE + 1
    pool.router.release(first, "aborted")
    for _ in range(5):
        before = _hash_reads(routing_redis)
        slot = pool.router.acquire(job)
        assert _hash_reads(routing_redis) - before == 1  # its backend's five fields; 200 before issue 37
        assert slot.backend.id == first.backend.id and slot.load == 0
        pool.router.release(slot, "aborted")


def _reference(state: dict, sticky: str, reprefill: float) -> str:
    """The scan of every backend (the routing module's docstring), for backends of distinct speeds:
    the earliest predicted finish among those with a free slot (else among all), and the sticky
    backend kept unless its queue costs more than a re-prefill on that one."""
    def eta(b: str) -> float:
        return (state[b]["load"] + 1) * state[b]["turn"]

    free = [b for b in state if state[b]["load"] < state[b]["cap"]]
    chosen = min(free or list(state), key=eta)
    if chosen != sticky:
        queued = state[sticky]["inflight"] + 1 - state[sticky]["cap"]
        pays = queued > 0 and state[chosen]["inflight"] < state[chosen]["cap"] and \
            queued * state[sticky]["turn"] > reprefill * state[chosen]["turn"]
        if not pays:
            chosen = sticky
    return chosen


@pytest.mark.unit
def test_the_sticky_backends_free_slot_is_the_choice_the_scan_of_every_backend_makes(pool):
    """Random loads on six backends, the rollout's own backend free or full: the router's choice (its
    fast path when the sticky backend has a free slot) is the full scan's, as the docstring states it."""
    ids = _register(pool, 6, capacity=4)
    rng, client, reprefill = random.Random(37), pool.router.redis, get_settings().llm_sticky_reprefill_turns
    fast = 0
    for trial in range(40):
        job, now_ms = f"same-{trial}-{uuid.uuid4().hex[:6]}", int(time.time() * 1000)
        state = {}
        for bid in ids:
            cap = rng.randint(1, 6)
            sessions, inflight = rng.randint(0, 8), rng.randint(0, 8)
            client.delete(keys.llm_sessions(bid), keys.llm_inflight(bid))
            if sessions:
                client.zadd(keys.llm_sessions(bid), {f"other-{i}": now_ms for i in range(sessions)})
            if inflight:
                client.zadd(keys.llm_inflight(bid), {f"lease-{i}": now_ms + 60_000 for i in range(inflight)})
            turn = rng.uniform(0.05, 1.0)
            pool.registry.set_fields(bid, capacity=cap, turn_s=turn)
            state[bid] = {"cap": cap, "load": max(sessions, inflight), "inflight": inflight, "turn": turn}
        sticky = rng.choice(ids)
        client.zadd(keys.llm_sessions(sticky), {job: now_ms - 5000})  # the rollout's own session there
        client.set(keys.llm_sticky(job), sticky)
        fast += state[sticky]["load"] < state[sticky]["cap"]
        slot = pool.router.acquire(job)
        assert slot.backend.id == _reference(state, sticky, reprefill), (trial, sticky, state)
        assert slot.load == state[slot.backend.id]["load"]
        pool.router.release(slot, "aborted")
    assert 5 <= fast <= 35  # both paths were taken


@pytest.mark.unit
def test_a_projects_private_backend_is_found_among_200_it_may_not_use(pool):
    """No random backend may serve the job (another project's, or another protocol): the scan of
    every backend finds the one it may use, and its next call reads that one alone."""
    with project_jobs(pool, ("pa", "pb"), prefix="scale") as jobs:
        _register(pool, 150, capacity=4, project="pb")
        _register(pool, 50, start=150, capacity=4, protocol="generate", dialect="fake")
        mine, _ = pool.registry.add(BackendSpec(address="http://10.2.0.1:1", capacity=4, probe=False), project="pa")
        slot = pool.router.acquire(jobs["pa"], Protocol.CHAT)
        assert isinstance(slot, Slot) and slot.backend.id == mine.id
        pool.router.release(slot, "aborted")
        before = _hash_reads(pool.router.redis)
        again = pool.router.acquire(jobs["pa"], Protocol.CHAT)
        assert again.backend.id == mine.id and _hash_reads(pool.router.redis) - before == 1
        pool.router.release(again, "aborted")
        other = pool.router.acquire(jobs["pb"], Protocol.CHAT)  # pb's 150 and the shared generate ones
        assert isinstance(other, Slot) and other.backend.project == "pb"
        pool.router.release(other, "aborted")


@pytest.mark.unit
def test_a_processes_counters_are_the_writes_one_release_each_made(pool):
    """A process's outcomes on a backend, written at once by the counters' script, leave the figures
    one write per release left: served, failures, consecutive failures, the EWMA of ``turn_s``."""
    bid = _register(pool, 1, capacity=4)[0]
    client, key = pool.router.redis, keys.llm_backend(bid)
    client.hset(key, mapping={"served": 3, "failures": 1, "consecutive_failures": 2, "turn_s": 0.5})
    outcomes = [("ok", 0.2), ("failed", 0), ("ok", 0.9), ("ok", 0.4), ("failed", 0), ("failed", 0)]
    turn, run = 0.5, 2
    for outcome, sample in outcomes:  # what one write per release gave
        if outcome == "ok":
            turn, run = turn + counts.EWMA_W * (sample - turn), 0
        else:
            run += 1
    tallies = counts.Counts()
    for outcome, sample in outcomes:
        tallies.add(client, ("here",), bid, outcome, sample)
    assert tallies.flush() == 1
    record = pool.registry.get(bid)
    assert (record.served, record.failures, record.consecutive_failures) == (6, 4, run)
    assert float(client.hget(key, "turn_s")) == pytest.approx(turn, rel=1e-12)
    client.hdel(key, "turn_s")  # not measured yet: the first sample starts it
    tallies.add(client, ("here",), bid, "ok", 0.3)
    tallies.add(client, ("here",), bid, "ok", 0.5)
    tallies.flush()
    assert float(client.hget(key, "turn_s")) == pytest.approx(0.3 + counts.EWMA_W * 0.2, rel=1e-12)


@pytest.mark.unit
def test_the_counters_arrive_within_a_second_without_another_call(pool):
    bid = _register(pool, 1, capacity=4)[0]
    pool.router.release(pool.router.acquire(f"late-{uuid.uuid4().hex}"), "ok")
    deadline = time.monotonic() + counts.FLUSH_S + 3
    while pool.registry.get(bid).served != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.registry.get(bid).served == 1


@pytest.mark.unit
def test_one_writer_thread_writes_every_second_of_tallies(pool):
    """Tallies in two seconds apart are both written by the one thread the first started (a timer
    thread per second of traffic was the way before)."""
    bid = _register(pool, 1, capacity=4)[0]
    client = pool.router.redis
    tallies = counts.Counts()
    for n in (1, 2):
        tallies.add(client, ("here",), bid, "ok", 0.1)
        deadline = time.monotonic() + counts.FLUSH_S + 3
        while pool.registry.get(bid).served != n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.registry.get(bid).served == n
        if n == 1:
            writer = tallies.writer
    assert tallies.writer is writer and writer.is_alive() and writer.daemon


@pytest.mark.unit
def test_a_full_pool_of_40_backends_is_shared_by_weight_from_a_sample(pool):
    """Above ``SCAN_ALL`` the candidates' capacity is estimated from the random ones read (here
    exact: alike backends): a project past its weight's share of a full pool waits ('share'),
    another under its share queues."""
    names = weighted_projects(pool, "sc", big=1, small=3)
    big, small = names["big"], names["small"]
    with project_jobs(pool, (big, small), prefix="scale", per=200) as jobs:
        _register(pool, 40, capacity=1)
        mine = [pool.router.acquire(job_id) for job_id in jobs[big]]  # alone: never held, every slot taken
        assert all(isinstance(s, Slot) for s in mine)
        assert sum(pool.registry.in_flight(b.id) for b in pool.registry.list()) == 200
        assert all(pool.registry.in_flight(b.id) >= 1 for b in pool.registry.list())
        theirs = pool.router.acquire(jobs[small][0])  # 0 of its share of 30: it queues
        assert isinstance(theirs, Slot)
        assert pool.router.acquire(jobs[big][0]) == "share"  # 200 against its share of 10
        for slot in [*mine, theirs]:
            pool.router.release(slot, "aborted")


@pytest.mark.unit
def test_a_projects_hour_of_tokens_is_read_whole_once_a_minute_and_its_lapsed_minutes_dropped(pool):
    """Three hours of minutes in the project's tokens hash: the first acquire counts the last 60
    (the others dropped), the next ones read this minute's field and the kept sum only; the quota
    holds at the hour's sum as before."""
    from prorl_celery.jobs import JobStore
    from prorl_celery.models import JobRequest
    from prorl_celery.projects import ProjectStore
    from prorl_celery.status import JobStatus

    tag = uuid.uuid4().hex[:8]
    project, job = f"tok-{tag}", f"scale-tok-{tag}"
    ProjectStore(pool.redis).add(project)
    ProjectStore(pool.redis).set_quotas(project, {"tokens_per_hour": 6000})
    store = JobStore(pool.redis)
    store.create_many([(job, JobRequest(instance={"data_source": "shell"}))], project=project)
    client, key = pool.router.redis, keys.llm_project_tokens(project)
    try:
        _register(pool, 1, capacity=64)
        minute = int(time.time() // 60)
        if time.time() % 60 > 55:  # not across a minute's end
            time.sleep(60 - time.time() % 60 + 0.1)
            minute = int(time.time() // 60)
        client.hset(key, mapping={minute - i: 100 for i in range(1, 180)})  # the last hour: 59 x 100 before this one
        client.expire(key, 3700)
        slot = pool.router.acquire(job)
        assert isinstance(slot, Slot)
        fields = {int(k) for k in client.hkeys(key)}
        assert fields == {0, 1, *(minute - i for i in range(1, 60))}  # lapsed minutes dropped, the sum kept
        before = client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0)
        pool.router.release(slot, "aborted")
        client.hincrby(key, minute, 99)  # 5,900 + 99: under 6,000
        slot = pool.router.acquire(job)
        assert isinstance(slot, Slot)
        pool.router.release(slot, "aborted")
        client.hincrby(key, minute, 1)  # 6,000: at the quota
        assert pool.router.acquire(job) == "quota"
        assert client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0) == before  # not read whole
    finally:
        store.transition(job, JobStatus.CANCELLED)
