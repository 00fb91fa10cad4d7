"""Stage and call leases against the session's Redis: kept alive while held, renewed only when
due, by one keeper thread that also reports a withdrawn call lease."""
from __future__ import annotations

import threading
import time
import uuid

from prorl_celery import keys
from prorl_celery.leases import HeldLease, Lease, keeper


def _lease(redis_client, ttl_s: float) -> Lease:
    return Lease(redis_client, f"test:lease:{uuid.uuid4().hex}", ttl_s, owner="test")


def test_a_held_lease_outlives_its_expiry_and_a_released_one_is_gone(redis_client):
    lease = _lease(redis_client, 0.3)
    assert lease.acquire()
    assert not Lease(redis_client, lease.key, 0.3, owner="other").acquire()  # taken
    time.sleep(1.2)  # four expiries: only renewals keep it
    assert redis_client.get(lease.key) == lease.token.encode()
    lease.release()
    assert redis_client.exists(lease.key) == 0


def test_taking_a_lease_does_not_renew_the_others(redis_client):
    first = _lease(redis_client, 3.0)
    assert first.acquire()
    time.sleep(0.5)
    second = _lease(redis_client, 3.0)
    assert second.acquire()
    time.sleep(0.1)  # time for a keeper that renews everything on each new lease to do so
    try:
        assert redis_client.pttl(first.key) < 2600  # still counting down from its own start
    finally:
        first.release()
        second.release()


class _Watched:
    """A watched call without HTTP: what the transport's Call gives the keeper."""

    def __init__(self, lease: HeldLease):
        self.lease, self.reason, self.ticks = lease, None, 0

    def tick(self, now: float) -> None:
        self.ticks += 1

    def lost(self) -> None:
        self.reason = "lost"


def _call_lease(redis_client, ttl_s: float) -> HeldLease:
    key, token = f"test:inflight:{uuid.uuid4().hex}", uuid.uuid4().hex
    redis_client.zadd(key, {token: int(time.time() * 1000 + ttl_s * 1000)})
    return HeldLease(redis_client, key, token, ttl_s)


def test_one_keeper_renews_stage_and_call_leases_and_reports_a_withdrawn_one(redis_client):
    stage = _lease(redis_client, 0.3)
    assert stage.acquire()
    kept, withdrawn = (_Watched(_call_lease(redis_client, 0.3)) for _ in range(2))
    for call in (kept, withdrawn):
        keeper().watch(call)
    try:
        redis_client.zrem(withdrawn.lease.key, withdrawn.lease.token)  # as a drain with abort does,
        redis_client.incr(keys.llm_withdrawals())                      # telling the keepers
        first = redis_client.zscore(kept.lease.key, kept.lease.token)
        time.sleep(1.2)  # four expiries of each
        assert redis_client.get(stage.key) == stage.token.encode()
        assert redis_client.zscore(kept.lease.key, kept.lease.token) > first + 600  # renewed
        assert (kept.reason, withdrawn.reason) == (None, "lost")
        assert kept.ticks >= 5  # the calls' own checks, every TICK_S
        names = [t.name for t in threading.enumerate()]
        assert names.count("lease-keeper") == 1 and "llm-call-monitor" not in names
    finally:
        for call in (kept, withdrawn):
            keeper().unwatch(call)
        stage.release()


def test_an_unwatched_call_lease_is_left_to_lapse(redis_client):
    call = _Watched(_call_lease(redis_client, 0.3))
    keeper().watch(call)
    keeper().unwatch(call)
    score = redis_client.zscore(call.lease.key, call.lease.token)
    time.sleep(0.6)
    assert redis_client.zscore(call.lease.key, call.lease.token) == score


def test_a_call_lease_that_lapsed_but_was_not_swept_is_lost(redis_client):
    """The router removes lapsed leases only now and then (routing.SWEEP_P) and counts by expiry:
    a lease whose expiry passed (its holder stalled past it) is lost to the keeper although still
    in the set, as if it had been removed; a live one beside it is not."""
    lapsed, live = (_Watched(_call_lease(redis_client, 5.0)) for _ in range(2))
    redis_client.zadd(lapsed.lease.key, {lapsed.lease.token: int(time.time() * 1000) - 1})
    for call in (lapsed, live):
        keeper().watch(call)
    try:
        deadline = time.monotonic() + 3
        while lapsed.reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (lapsed.reason, live.reason) == ("lost", None)
    finally:
        for call in (lapsed, live):
            keeper().unwatch(call)


def test_the_stage_leases_due_are_renewed_by_one_script_call(redis_client, caplog):
    """A worker holding many stage leases renews those due in one round with one EVALSHA, not
    one command each; a lease another holder took meanwhile is reported, not renewed."""
    from prorl_celery.leases import Keeper

    held = [Lease(redis_client, f"test:lease:{uuid.uuid4().hex}", 30.0, owner="test") for _ in range(40)]
    for lease in held:
        assert redis_client.set(lease.key, lease.token, px=5000)
    redis_client.set(held[0].key, "someone-else", px=5000)
    own = Keeper()  # not started: its passes are driven here
    for lease in held:
        own.hold(lease)
        lease.due = 0.0  # all due
    before = redis_client.info("commandstats")
    own._pass(time.monotonic())
    after = redis_client.info("commandstats")
    calls = {k: after[k]["calls"] - before.get(k, {}).get("calls", 0) for k in after}
    assert calls.get("cmdstat_evalsha", 0) + calls.get("cmdstat_eval", 0) == 1  # one call for the 40
    assert calls.get("cmdstat_pexpire") == 39 and calls.get("cmdstat_get") == 40
    assert all(redis_client.pttl(lease.key) > 25000 for lease in held[1:])
    assert redis_client.pttl(held[0].key) <= 5000
    assert "was lost before renewal" in caplog.text


def test_call_leases_are_checked_every_call_check_s_not_at_every_renewal(redis_client):
    """A worker's many calls are due for renewal at staggered times, so some are due in most of
    the keeper's ticks; asking which are still there (one ZMSCORE of every watched call) is done
    every CALL_CHECK_S, not at each of those renewals, and the due ones are renewed meanwhile."""
    from prorl_celery.leases import CALL_CHECK_S, Keeper

    key = f"test:inflight:{uuid.uuid4().hex}"
    calls = []
    for _ in range(30):
        token = uuid.uuid4().hex
        redis_client.zadd(key, {token: int(time.time() * 1000 + 30_000)})
        calls.append(_Watched(HeldLease(redis_client, key, token, 30.0)))
    own = Keeper()  # not started: its passes are driven here
    for call in calls:
        own.watch(call)
    start = time.monotonic()
    before = redis_client.info("commandstats")
    for k in range(10):  # ten ticks within one CALL_CHECK_S, a call due at each
        calls[k].lease.due = 0.0
        own._pass(start + k * CALL_CHECK_S / 20)
    after = redis_client.info("commandstats")
    checks = after["cmdstat_zmscore"]["calls"] - before.get("cmdstat_zmscore", {}).get("calls", 0)
    renewals = after["cmdstat_zadd"]["calls"] - before.get("cmdstat_zadd", {}).get("calls", 0)
    assert checks == 1 and renewals == 10
    assert all(call.lease.due > start for call in calls[:10])


def _zmscores(redis_client) -> int:
    return redis_client.info("commandstats").get("cmdstat_zmscore", {}).get("calls", 0)


def test_call_leases_are_asked_about_only_when_withdrawals_moved_or_at_a_sweep(redis_client):
    """A run worker's thousand calls: asking Redis about every one of them at each check (twice a
    second) was most of the routing Redis's time outside the turns. The keeper reads the
    withdrawals counter at each check and asks about its calls only when it moved, or every
    CALL_SWEEP_S; a withdrawal through the registry is noticed at the next check, one that did
    not raise the counter (a lapse) at the next sweep."""
    from prorl_celery.leases import CALL_CHECK_S, CALL_SWEEP_S, Keeper
    from prorl_celery.llm.registry import BackendRegistry

    bid = f"test-{uuid.uuid4().hex[:8]}"
    calls = []
    for _ in range(20):
        token = uuid.uuid4().hex
        redis_client.zadd(keys.llm_inflight(bid), {token: int(time.time() * 1000 + 30_000)})
        calls.append(_Watched(HeldLease(redis_client, keys.llm_inflight(bid), token, 30.0)))
    lapsed = _Watched(_call_lease(redis_client, 30.0))
    own = Keeper()  # not started: its passes are driven here
    for call in (*calls, lapsed):
        own.watch(call)
    start, before = time.monotonic(), _zmscores(redis_client)
    checks = int(CALL_SWEEP_S / CALL_CHECK_S) - 2
    for k in range(checks):  # nothing withdrawn: only the first check asks (a sweep)
        own._pass(start + k * CALL_CHECK_S)
        calls[k].lease.due = 0.0  # a renewal due between checks: a pass that reads no counter
        own._pass(start + (k + 0.5) * CALL_CHECK_S)
    assert _zmscores(redis_client) - before == 2  # the sweep's: one per lease set
    # a lapse (no counter): not seen at a check, seen at the sweep
    redis_client.zadd(lapsed.lease.key, {lapsed.lease.token: int(time.time() * 1000) - 1})
    own._pass(start + checks * CALL_CHECK_S)
    assert lapsed.reason is None
    own._pass(start + CALL_SWEEP_S)
    assert lapsed.reason == "lost" and {call.reason for call in calls} == {None}
    # a withdrawal through the registry: seen at the next check
    assert BackendRegistry(redis_client).abort_in_flight(bid) == 20
    own._pass(start + CALL_SWEEP_S + CALL_CHECK_S)
    assert {call.reason for call in calls} == {"lost"}
