"""LLMPool.generate against real fake-server processes: load, failures, drain/resume, cancel."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from prorl_celery import keys
from prorl_celery.errors import BackendUnavailable, LLMCallCancelled, LLMTimeout
from prorl_celery.llm import BackendStatus, LLMRequest, SamplingParams
from prorl_celery.llm.control import drain, resume
from prorl_celery.llm.health import probe, probe_quarantined
from tests.llm.conftest import add, eventually

SLOW = "step_s=0.01,capacity=4"


def ask(text: str = "hi", tokens: int = 20, **extra) -> LLMRequest:
    return LLMRequest(messages=[{"role": "user", "content": text}],
                      sampling=SamplingParams(max_tokens=tokens, ignore_eos=True), **extra)


def rollout(pool, job_id: str, turns: int, tokens: int = 20, stop=None) -> list:
    """A multi-turn conversation: each turn appends the answer and a tool message."""
    messages = [{"role": "user", "content": f"task {job_id}"}]
    out, previous = [], None
    for k in range(turns):
        turn = pool.generate(job_id, LLMRequest(messages=messages, previous=previous,
                                                sampling=SamplingParams(max_tokens=tokens, ignore_eos=True)),
                             should_stop=stop)
        messages = messages + [turn.message, {"role": "tool", "content": f"observation {k}"}]
        out.append(turn)
        previous = turn
    return out


def test_in_flight_returns_to_zero(pool, fake_llms):
    procs = fake_llms(2, latency=SLOW)
    ids = [add(pool, p, capacity=4) for p in procs]
    peak = [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], sum(b.in_flight for b in pool.registry.list()))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(12) as ex:
        results = list(ex.map(lambda i: rollout(pool, f"job-{i}", 3), range(12)))
    done.set()
    watcher.join()
    assert peak[0] >= 6
    backends = pool.registry.list()
    assert [b.in_flight for b in backends] == [0, 0]
    pool.router.flush_counts()  # (written by this process within counts.FLUSH_S)
    backends = pool.registry.list()
    assert sum(b.served for b in backends) == 36 and {b.id for b in backends} == set(ids)
    assert all(len(turns) == 3 for turns in results)


def test_new_backend_gets_a_fair_share_under_load(pool, fake_llms):
    old = fake_llms(2, latency="step_s=0.005,capacity=4")
    (new,) = fake_llms(1, latency="step_s=0.005,capacity=4")
    for proc in old:
        add(pool, proc, capacity=4)
    stop = threading.Event()
    seen: list[tuple[float, str]] = []

    def worker(i: int):
        k = 0
        while not stop.is_set():
            turn = pool.generate(f"w{i}-{k // 3}", ask(tokens=10))  # 3 turns per rollout
            seen.append((time.monotonic(), turn.backend_id))
            if k % 3 == 2:
                pool.end_rollout(f"w{i}-{k // 3}")
            k += 1

    with ThreadPoolExecutor(12) as ex:
        futures = [ex.submit(worker, i) for i in range(12)]
        time.sleep(1.0)
        added_at = time.monotonic()
        new_id = add(pool, new, capacity=4)
        time.sleep(1.5)
        stop.set()
        for f in futures:
            f.result()
    after = [bid for t, bid in seen if t > added_at + 0.1]
    share = after.count(new_id) / len(after)
    assert len(after) > 60
    assert 0.2 < share < 0.55, share  # fair is 1/3; the reference's heap would send it everything


def test_faster_backend_holds_more_rollouts_and_none_moves(pool, fake_llms):
    """Speeds 1 and 0.25 behind equal capacities: the measured speed, not the capacity, decides
    where new rollouts go, and a rollout stays where its prefix is (no queue forces it out)."""
    fast_proc, slow_proc = fake_llms(2, latency="step_s=0.01,capacity=8", speeds=[1.0, 0.25])
    fast, slow = add(pool, fast_proc, capacity=8), add(pool, slow_proc, capacity=8)
    turns: list[list] = []
    with ThreadPoolExecutor(6) as ex:
        for batch in range(3):
            jobs = [f"speed-{batch}-{i}-{time.monotonic_ns()}" for i in range(6)]
            turns += ex.map(lambda job: rollout(pool, job, 3, tokens=10), jobs)
            for job in jobs:
                pool.end_rollout(job)
    assert all(len({t.backend_id for t in rollout_turns}) == 1 for rollout_turns in turns)  # never moved
    late = [rollout_turns[0].backend_id for rollout_turns in turns[6:]]  # once both are measured
    assert late.count(fast) >= 2 * late.count(slow), (late.count(fast), late.count(slow))
    assert pool.router.redis.zcard(keys.llm_sessions(fast)) == pool.router.redis.zcard(keys.llm_sessions(slow)) == 0


def test_removing_a_backend_mid_run_loses_no_rollout(pool, fake_llms):
    # a's turns long enough (~5 s) that its requests are still in flight when the keeper notices
    # the removal (within CALL_CHECK_S, later on a loaded machine): at ~1 s a turn a busy CI run
    # saw them all finish first; b's turns ~1 s
    procs = fake_llms(2, latency="step_s=0.05,capacity=8", speeds=[0.2, 1.0])
    a, b = (add(pool, p, capacity=8) for p in procs)
    with ThreadPoolExecutor(8) as ex:
        futures = [ex.submit(rollout, pool, f"r{i}", 4) for i in range(8)]
        eventually(lambda: pool.registry.get(a).in_flight > 0, 5, "traffic on a")
        pool.registry.remove(a)
        removed_at = time.time()
        results = [f.result(timeout=60) for f in futures]
    assert all(len(turns) == 4 for turns in results)
    late = [t for turns in results for t in turns if t.started_at > removed_at]
    assert late and all(t.backend_id == b for t in late)
    assert procs[0].stats()["aborted"] >= 1  # its in-flight requests were aborted and retried
    assert pool.registry.get(b).in_flight == 0


def test_probe_tells_up_unhealthy_and_gone_apart(fake_llms):
    (server,) = fake_llms(1)
    assert probe(server.url, api_key="k") is None
    server.faults(healthy=False)
    assert probe(server.url) == "GET /v1/models -> 503"  # /health first, then /v1/models
    server.child.stop(grace_s=2)
    assert probe(server.url).startswith("TransportError: ")


def test_failing_backend_is_quarantined_and_probed_back(pool, fake_llms):
    bad, good = fake_llms(2, latency="step_s=0.005,capacity=8")
    bad_id, good_id = (add(pool, p, capacity=8, model="prorl-fake-byte") for p in (bad, good))
    bad.faults(fail_all=True, healthy=False)
    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(lambda i: rollout(pool, f"q{i}", 3), range(6)))
    assert all(len(turns) == 3 for turns in results)
    assert {t.backend_id for turns in results for t in turns} == {good_id}
    record = pool.registry.get(bad_id)
    assert record.status is BackendStatus.QUARANTINED and record.failures >= 1
    assert "/v1/chat/completions -> 500" in record.last_error
    assert any(t.attempts > 1 for turns in results for t in turns)
    time.sleep(0.35)
    assert probe_quarantined(pool.redis) == {bad_id: False}  # still down
    bad.faults(fail_all=False, healthy=True)
    time.sleep(0.35)
    assert probe_quarantined(pool.redis) == {bad_id: True}
    assert pool.registry.get(bad_id).status is BackendStatus.ACTIVE


def test_connection_refused_then_retry_budget(pool, fake_llms):
    (proc,) = fake_llms(1)
    bid = add(pool, proc)
    proc.faults(fail_all=True, error_status=0)  # drops every connection, /health still answers
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as err:
        pool.generate("doomed", ask())
    assert "retry budget 3" in str(err.value) and err.value.type == "backend_unavailable"
    assert time.monotonic() - started < 10
    assert pool.registry.get(bid).failures == 4  # the first try and three retries
    assert proc.stats()["errors"] == 4


def test_only_backend_down_then_back_is_probed_on_demand(pool, fake_llms):
    (proc,) = fake_llms(1)
    bid = add(pool, proc)
    proc.faults(fail_next=1)
    turn = pool.generate("j", ask())  # fails once; quarantined; the on-demand probe restores it
    assert turn.backend_id == bid and turn.attempts == 2
    assert pool.registry.get(bid).status is BackendStatus.ACTIVE


def test_drain_waits_and_resume_sets_new_weight_version(pool, fake_llms):
    procs = fake_llms(2, latency="step_s=0.01,capacity=8")
    ids = [add(pool, p, capacity=8, weight_version="v1") for p in procs]
    results: dict[int, list] = {}

    def run(i):
        results[i] = rollout(pool, f"d{i}", 6, tokens=15)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    eventually(lambda: sum(pool.registry.get(b).in_flight for b in ids) > 0, 5, "traffic")
    started = time.monotonic()
    outcome = drain(pool.registry, None, wait_s=10)
    drained_at = time.time()
    assert outcome["drained"] and outcome["in_flight"] == {b: 0 for b in ids}
    assert time.monotonic() - started > 0.02  # it had to wait for the requests in flight
    time.sleep(0.5)
    pool.router.flush_counts()  # the calls served before the drain, written now (else within counts.FLUSH_S)
    served = sum(b.served for b in pool.registry.list())
    assert all(t.is_alive() for t in threads)  # rollouts wait while everything drains
    assert sum(b.served for b in pool.registry.list()) == served
    resume(pool.registry, None, weight_version="v2")
    resumed_at = time.time()
    for t in threads:
        t.join(30)
    turns = [t for i in range(6) for t in results[i]]
    assert len(turns) == 36
    assert all(t.weight_version == "v1" for t in turns if t.started_at + t.latency_s < drained_at)
    later = [t for t in turns if t.started_at > resumed_at]
    assert later and all(t.weight_version == "v2" for t in later)
    assert {t.weight_version for t in turns} == {"v1", "v2"}


def test_drain_with_abort_retries_after_resume(pool, fake_llms):
    # 3 s of tokens: the keeper notices the withdrawn lease within CALL_CHECK_S (0.5 s) on an idle
    # machine; the margin is for a loaded one, where a 1 s request could finish first
    (proc,) = fake_llms(1, latency="step_s=0.05,capacity=8")
    bid = add(pool, proc, weight_version="v1")
    box, stop = {}, threading.Event()
    worker = threading.Thread(target=lambda: box.setdefault(
        "turn", pool.generate("a", ask(tokens=60), should_stop=stop.is_set)))
    worker.start()
    try:
        eventually(lambda: pool.registry.get(bid).in_flight == 1, 5, "the request in flight")
        outcome = drain(pool.registry, [bid], wait_s=5, abort=True)
        assert outcome == {"drained": True, "in_flight": {bid: 0}, "aborted": {bid: 1}}
        eventually(lambda: proc.stats()["aborted"] == 1, 5, "the server to see the abort")
        resume(pool.registry, [bid], weight_version="v2")
        worker.join(30)
    finally:  # a failed assertion must not leave the call running into the next test's backends
        stop.set()
        worker.join(10)
    turn = box["turn"]
    assert turn.weight_version == "v2" and turn.attempts == 2
    assert [r["status"] for r in proc.received()] == ["aborted", "ok"]


def test_cancel_aborts_the_request_in_flight(pool, fake_llms):
    (proc,) = fake_llms(1, latency="step_s=0.5,capacity=4")
    bid = add(pool, proc)
    flag = threading.Event()
    threading.Timer(0.5, flag.set).start()
    started = time.monotonic()
    with pytest.raises(LLMCallCancelled):
        pool.generate("c", ask(tokens=100), should_stop=flag.is_set)
    assert time.monotonic() - started < 1.5
    eventually(lambda: proc.stats()["aborted"] == 1, 5, "the server to see the disconnect")
    record = pool.registry.get(bid)
    assert record.in_flight == 0 and record.failures == 0 and record.status is BackendStatus.ACTIVE


def test_timeout_quarantines_and_retries_elsewhere(pool, fake_llms, monkeypatch):
    from config.settings import get_settings

    monkeypatch.setattr(get_settings(), "llm_call_timeout_s", 1.0)
    slow, fast = fake_llms(2, latency="step_s=0.01,capacity=4", speeds=[0.01, 1.0])
    slow_id, fast_id = add(pool, slow), add(pool, fast)
    pool.registry.set_status(fast_id, BackendStatus.DRAINING, [BackendStatus.ACTIVE])
    threading.Timer(0.3, lambda: resume(pool.registry, [fast_id])).start()
    turn = pool.generate("t", ask(tokens=20))
    assert turn.backend_id == fast_id and turn.attempts == 2
    assert pool.registry.get(slow_id).status is BackendStatus.QUARANTINED
    assert "timed out" in pool.registry.get(slow_id).last_error
    eventually(lambda: slow.stats()["aborted"] == 1, 5, "the slow server to see the disconnect")
    resume(pool.registry, [slow_id])
    pool.registry.set_status(fast_id, BackendStatus.DRAINING, [BackendStatus.ACTIVE])
    with pytest.raises(LLMTimeout):  # a shorter timeout is the caller's deadline: no retry, no quarantine
        pool.generate("t2", ask(tokens=20, timeout_s=0.3))
    assert pool.registry.get(slow_id).status is BackendStatus.ACTIVE


def test_quarantined_backend_comes_back_while_others_carry_the_load(pool, fake_llms):
    """No beat sweep here: the pool's own background probe brings the backend back."""
    flaky, steady = fake_llms(2)
    flaky_id = add(pool, flaky, model="prorl-fake-byte")
    add(pool, steady, model="prorl-fake-byte")
    flaky.faults(fail_next=1)
    used = set()
    deadline = time.monotonic() + 10
    while pool.registry.get(flaky_id).status is not BackendStatus.QUARANTINED and time.monotonic() < deadline:
        used.add(pool.generate(f"x{len(used)}-{time.monotonic()}", ask(tokens=4)).backend_id)
    assert pool.registry.get(flaky_id).status is BackendStatus.QUARANTINED
    eventually(lambda: pool.generate("y", ask(tokens=4)) and
               pool.registry.get(flaky_id).status is BackendStatus.ACTIVE, 5, "the background probe")


def test_deferred_releases_are_held_until_sent_and_free_every_lease(pool, fake_llms, redis_conn):
    """The gateway's pool defers a call's release until its thread sends them (after answering
    its own caller): the lease is held until then; sent, every lease is freed and every call
    counted, from concurrent threads too."""
    from prorl_celery.llm import LLMPool

    procs = fake_llms(2)
    for proc in procs:
        add(pool, proc, capacity=4)
    quick = LLMPool(redis_conn, defer_release=True)
    quick.generate("held", ask(tokens=4))
    assert sum(b.in_flight for b in pool.registry.list()) == 1  # held until sent
    assert quick.send_releases() == 1 and quick.send_releases() == 0
    assert sum(b.in_flight for b in pool.registry.list()) == 0

    def run(i: int) -> tuple[list, int]:
        turns = rollout(quick, f"deferred-{i}", 3, tokens=4)
        return turns, quick.send_releases()

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(run, range(8)))
    assert all(len(turns) == 3 and sent == 3 for turns, sent in results)
    pool.router.flush_counts()
    backends = pool.registry.list()
    assert sum(b.served for b in backends) == 25 and [b.in_flight for b in backends] == [0, 0]
