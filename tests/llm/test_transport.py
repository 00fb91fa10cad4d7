"""LLM calls against a real Redis and a real (fake) server: a call longer than its lease keeps it
by the keeper's renewals; one whose lease is withdrawn is aborted as ``lost``; calls on one
thread share a keep-alive connection, and an aborted call's connection is not reused."""
from __future__ import annotations

import threading
import time

import pytest

from prorl_celery import http, keys
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.transport import Call, CallAborted, request_json
from tests.llm.conftest import add, eventually

BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 20}], "max_tokens": 20, "ignore_eos": True}


def _call(slot: Slot, out: dict) -> None:
    try:
        with Call(30, lease=slot.lease) as call:
            out["status"] = request_json(call, "POST", slot.backend.address + "/v1/chat/completions", BODY)[0]
    except CallAborted as exc:
        out["aborted"] = exc.reason


def test_a_call_longer_than_its_lease_keeps_it(pool, fake_llms):
    (slow,) = fake_llms(1, latency="step_s=0.12,capacity=4")  # ~2.4 s: four lease expiries
    bid = add(pool, slow)
    slot = pool.router.acquire("long", lease_s=0.6)
    other = pool.router.acquire("short", lease_s=0.6)  # on the same lease set, never renewed
    out: dict = {}
    thread = threading.Thread(target=_call, args=(slot, out))
    thread.start()
    eventually(lambda: pool.registry.get(bid).in_flight == 1, 3, "the other lease to lapse")
    scores = []
    while thread.is_alive():
        scores.append(pool.router.redis.zscore(slot.lease.key, slot.lease.token))
        time.sleep(0.2)
    thread.join()
    assert out == {"status": 200}
    assert None not in scores and len(set(scores)) >= 3  # renewed again and again, never lost
    pool.router.release(slot, "ok")
    pool.router.release(other, "aborted")


@pytest.mark.parametrize("calls", [1, 3])
def test_a_withdrawn_lease_aborts_its_call_only(pool, fake_llms, calls):
    (slow,) = fake_llms(1, latency="step_s=0.2,capacity=8")
    add(pool, slow)
    slots = [pool.router.acquire(f"job-{i}") for i in range(calls)]
    outs = [{} for _ in slots]
    threads = [threading.Thread(target=_call, args=(s, o)) for s, o in zip(slots, outs)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    pool.router.redis.zrem(slots[0].lease.key, slots[0].lease.token)  # as a drain with abort does,
    pool.router.redis.incr(keys.llm_withdrawals())                     # telling the keepers
    for t in threads:
        t.join(timeout=20)
    assert outs[0] == {"aborted": "lost"}
    assert all(o == {"status": 200} for o in outs[1:])
    for slot in slots:
        pool.router.release(slot, "ok")


def _local_port(url: str) -> int | None:
    conn = http._conns().get(http._key(url)[0])
    return conn.sock.getsockname()[1] if conn is not None and conn.sock is not None else None


def test_calls_reuse_the_connection_and_an_abort_drops_it(fake_llms):
    (fake,) = fake_llms(1, latency="step_s=0.2,capacity=4")
    url = fake.url + "/v1/chat/completions"
    out: dict = {}
    short = {**BODY, "max_tokens": 1}

    def run() -> None:
        with Call(30) as call:
            request_json(call, "POST", url, short)
        out["first"] = _local_port(url)
        with Call(30) as call:
            request_json(call, "POST", url, short)
        out["second"] = _local_port(url)
        started = time.monotonic()
        try:
            with Call(30, should_stop=lambda: time.monotonic() - started > 0.3) as call:
                request_json(call, "POST", url, BODY)  # ~4 s if not aborted
        except CallAborted as exc:
            out["aborted"], out["abort_s"] = exc.reason, time.monotonic() - started
        with Call(30) as call:
            out["after"] = request_json(call, "POST", url, short)[0]
        out["after_port"] = _local_port(url)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert out["first"] == out["second"] is not None  # kept alive across calls
    assert out["aborted"] == "cancelled" and out["abort_s"] < 2.0
    assert out["after"] == 200 and out["after_port"] != out["second"]  # the aborted socket not reused
