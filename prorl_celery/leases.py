"""Leases: Redis entries with an expiry that their holder renews while it lives, and the one
keeper thread per process that renews them all.

Two shapes: a stage lease (:class:`Lease`, a key whose value is the holder's token; when the
process dies it lapses, which is how the sweep learns that a stage's worker is gone) and an LLM
call's in-flight lease (:class:`HeldLease`, a member of a backend's sorted set scored by its
expiry). The keeper renews each a third of its expiry after it was taken or last renewed, and
tells a watched call (an LLM call, :mod:`prorl_celery.llm.transport`) when its lease was
withdrawn (a drain with abort, the backend removed, the lease lapsed) so the call is aborted.

Its Redis traffic does not grow with the number of leases: one pipelined round trip per Redis
client per round, holding one script call that renews every stage lease due (``_RENEW_MANY``, by
its digest: a fleet's head renews its 100,000 stage leases in a few commands a round per worker,
not one each; a lease due within a sixth of its expiry is renewed with them) and one ``ZADD XX`` per lease set for the call
leases due (``XX`` never brings back a lease withdrawn meanwhile). Between rounds the watched
calls are ticked every ``TICK_S`` (their deadlines and cancellation checks).

Which calls lost their lease: whatever withdraws leases (a backend removed, a drain or pause with
abort: :mod:`prorl_celery.llm.registry`) raises a counter (``keys.llm_withdrawals``) in the same
step; the keeper reads it every ``CALL_CHECK_S`` and, only when it moved, asks about every
watched call (one ``ZMSCORE`` per lease set, a second round trip). It asks anyway every
``CALL_SWEEP_S``, for what no counter tells: a lease that lapsed (its holder stalled past its
expiry) or a routing Redis that lost its data. Asking every ``CALL_CHECK_S`` was a ``ZMSCORE``
of a run worker's thousand calls twice a second, ~12 % of the routing Redis's own time per turn
(bench/RESULTS.md).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Protocol

import redis

from prorl_celery import keys
from prorl_celery.redisio import LuaScript, missing

log = logging.getLogger(__name__)

TICK_S = 0.1        # watched calls' own checks (deadline, cancellation)
CALL_CHECK_S = 0.5  # how soon a withdrawn call lease is noticed
CALL_SWEEP_S = 5.0  # how soon a lapsed one is (or any, on a Redis that lost its data)
IDLE_S = 1.0        # the keeper's longest sleep with nothing due

# A key held by a token (KEYS[1], ARGV[1]): its expiry renewed (ARGV[2] ms), or the key deleted,
# only while it still holds that token; 1 if it did. Also the Harbor fork lock's (tasks/harbor/fork.py).
RENEW_HELD = LuaScript("""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
""")
RELEASE_HELD = LuaScript("""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")  # sent by its digest: not the script each stage
# KEYS: stage leases; ARGV: each one's token and ttl (ms), in turn. 1 for each renewed, 0 for each
# no longer this holder's.
_RENEW_MANY = LuaScript("""
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[2 * i - 1] then out[i] = redis.call('PEXPIRE', key, ARGV[2 * i]) else out[i] = 0 end
end
return out
""")
_WITHDRAWALS = keys.llm_withdrawals()


class Lease:
    """A stage lease: ``key`` holds ``token`` while the holder lives."""

    def __init__(self, client: redis.Redis, key: str, ttl_s: float, owner: str = ""):
        self.redis = client
        self.key = key
        self.ttl_ms = max(int(ttl_s * 1000), 100)
        self.token = f"{owner}:{uuid.uuid4().hex}"
        self.due = 0.0
        """When the keeper renews it next (monotonic seconds)."""
        self.released = False

    def acquire(self) -> bool:
        if not self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms):
            return False
        keeper().hold(self)
        return True

    def renew(self) -> bool:
        return bool(RENEW_HELD(self.redis, [self.key], [self.token, self.ttl_ms]))

    def taken_elsewhere(self) -> None:
        """The lease's key was set for this token by another script in Redis (the job store's
        transition that starts the stage, ``JobStore.transition(take_lease_ms=...)``): renew it."""
        keeper().hold(self)

    def released_elsewhere(self) -> None:
        """The lease's key was released by another script in Redis (the job store's transition
        that ended the stage, ``JobStore.transition(lease_token=...)``): stop renewing it."""
        self.released = True
        keeper().drop(self)

    def release(self) -> None:
        if self.released:  # released already (by the job's change that ended its stage)
            return
        self.released = True
        keeper().drop(self)
        try:
            RELEASE_HELD(self.redis, [self.key], [self.token])
        except redis.RedisError:
            log.warning("could not release lease %s; it will lapse", self.key)


class HeldLease:
    """An in-flight lease: ``token`` in the sorted set ``key`` with an expiry score in ms."""

    def __init__(self, client: redis.Redis, key: str, token: str, ttl_s: float, also: str | None = None):
        self.redis, self.key, self.token, self.ttl_ms = client, key, token, int(ttl_s * 1000)
        self.also = also
        """Another sorted set holding the same token, renewed with it (a project's LLM requests)."""
        self.due = time.monotonic() + ttl_s / 3
        """When the keeper renews it next (monotonic seconds)."""


class Watched(Protocol):
    """What the keeper watches besides stage leases: an LLM call and its lease."""

    lease: HeldLease | None
    reason: str | None
    """Set once the call ended by an abort; the keeper then leaves its lease alone."""

    def tick(self, now: float) -> None:
        """Every ``TICK_S``: the call's own checks (deadline, cancellation)."""

    def lost(self) -> None:
        """Its lease was withdrawn."""


class Keeper(threading.Thread):
    """Renews each held lease when due and watches the open calls; see the module docstring."""

    def __init__(self) -> None:
        super().__init__(name="lease-keeper", daemon=True)
        self.leases: dict[str, Lease] = {}
        self.calls: set[Watched] = set()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.next_round = float("inf")
        self.next_check = 0.0
        self.next_sweep = 0.0
        self.withdrawals: dict[int, object] = {}  # per Redis client: the counter as last read
        self.pid = os.getpid()

    def hold(self, lease: Lease) -> None:
        lease.due = time.monotonic() + lease.ttl_ms / 3000
        with self.lock:
            self.leases[lease.token] = lease
            earlier = lease.due < self.next_round
        if earlier:
            self.wake.set()

    def drop(self, lease: Lease) -> None:
        with self.lock:
            self.leases.pop(lease.token, None)

    def watch(self, call: Watched) -> None:
        with self.lock:
            idle = not self.calls  # sleeping until the next stage lease is due, not ticking
            self.calls.add(call)
        if idle:
            self.wake.set()

    def unwatch(self, call: Watched) -> None:
        with self.lock:
            self.calls.discard(call)

    def run(self) -> None:
        while True:
            try:
                self.wake.clear()
                self._pass(time.monotonic())
            except Exception:  # noqa: BLE001 - the keeper must outlive any one bad pass
                log.exception("lease keeper pass failed")
            self.wake.wait(max(self._next_wake() - time.monotonic(), 0.0))

    def _pass(self, now: float) -> None:
        with self.lock:
            calls = list(self.calls)
            stages = [lease for lease in self.leases.values() if lease.due - lease.ttl_ms / 6000 <= now]
            if not any(lease.due <= now for lease in stages):
                stages = []  # none due yet: the early ones wait for a round that one due starts
        for call in calls:
            call.tick(now)
        held = [call for call in calls if call.lease is not None and call.reason is None]
        check = now >= self.next_check  # which call leases are still there: every CALL_CHECK_S,
        if check:                       # not at every renewal (a worker's thousand calls are due
            self.next_check = now + CALL_CHECK_S  # somewhere in most ticks)
            sweep = now >= self.next_sweep
            if sweep:
                self.next_sweep = now + CALL_SWEEP_S
        else:
            held = [call for call in held if call.lease.due <= now]
        for lease in stages:
            lease.due = now + lease.ttl_ms / 3000
        for client, stage_group, call_group in _by_client(stages, held):
            if not check:  # renewals only: no counter read, no call asked about
                _round(client, stage_group, call_group, now, self.leases)
            else:
                ask = _SWEEP if sweep else self.withdrawals.get(id(client), _UNREAD)
                self.withdrawals[id(client)] = _round(client, stage_group, call_group, now, self.leases, ask)

    def _next_wake(self) -> float:
        with self.lock:
            self.next_round = min((lease.due for lease in self.leases.values()),
                                  default=time.monotonic() + IDLE_S)
            if self.calls:
                return min(self.next_round, time.monotonic() + TICK_S)
            return self.next_round


Group = tuple[redis.Redis, list[Lease], list[Watched]]


def _by_client(stages: list[Lease], calls: list[Watched]) -> list[Group]:
    groups: dict[int, Group] = {}
    for lease in stages:
        groups.setdefault(id(lease.redis), (lease.redis, [], []))[1].append(lease)
    for call in calls:
        groups.setdefault(id(call.lease.redis), (call.lease.redis, [], []))[2].append(call)
    return list(groups.values())


_UNREAD = object()  # the withdrawals counter not read yet from this client
_SWEEP = object()   # a check that asks about every watched call whatever the counter says


def _round(client: redis.Redis, stages: list[Lease], calls: list[Watched], now: float,
           held: dict[str, Lease], ask: object = None) -> object:
    """One round trip to one Redis client: renew the stage leases due and the call leases due
    among ``calls``; abort the calls whose lease is gone. ``ask``: None between checks (``calls``
    are those due); at a check (``calls`` are all the watched ones) ``_SWEEP`` asks about every
    one, else ``ask`` is the withdrawals counter as last read, and they are asked about in a
    second round trip only if the counter, read with the rest, moved. Returns the counter as read
    now (``_UNREAD``: not read)."""
    by_key: dict[str, list[Watched]] = {}
    for call in calls:
        by_key.setdefault(call.lease.key, []).append(call)
    checked = by_key if ask is _SWEEP else {}
    counter = _UNREAD
    reads = ask is not None and bool(calls)  # the counter's reply then comes first
    pipe = client.pipeline(transaction=False)
    if reads:
        pipe.get(_WITHDRAWALS)
    now_ms = time.time() * 1000
    renew = [x for lease in stages for x in (lease.token, lease.ttl_ms)]
    if stages:
        _RENEW_MANY.queue(pipe, [lease.key for lease in stages], renew)
    for key, group in checked.items():
        pipe.zmscore(key, [call.lease.token for call in group])
    renewed = _renew_calls(pipe, by_key, now)
    try:
        replies = pipe.execute(raise_on_error=False)
        first = 1 if reads else 0
        if stages and missing(replies[first]):  # a Redis new to it
            replies[first] = _RENEW_MANY.whole(client, [lease.key for lease in stages], renew)
        failed = next((r for r in replies if isinstance(r, Exception)), None)
        if failed is not None:
            raise failed
    except redis.RedisError as exc:
        log.warning("lease renewal failed: %s", exc)
        return _UNREAD if ask is _SWEEP else ask
    for lease in renewed:
        lease.due = now + lease.ttl_ms / 3000
    if reads:
        counter, replies = replies[0], replies[1:]
    if stages:
        for lease, ok in zip(stages, replies[0]):
            if not ok and lease.token in held:  # not merely released meanwhile
                log.warning("lease %s was lost before renewal", lease.key)
        replies = replies[1:]
    if ask is not None and ask is not _SWEEP and counter != ask:  # leases were withdrawn since the last reading
        checked = by_key
        pipe = client.pipeline(transaction=False)
        for key, group in checked.items():
            pipe.zmscore(key, [call.lease.token for call in group])
        try:
            replies = pipe.execute()
        except redis.RedisError as exc:
            log.warning("asking which call leases are left failed: %s", exc)
            return ask  # asked again at the next check
    for group, scores in zip(checked.values(), replies):
        for call, score in zip(group, scores):
            if score is None or score <= now_ms:  # gone, or lapsed (the router sweeps lazily)
                call.lost()
    return counter


def _renew_calls(pipe: redis.client.Pipeline, by_key: dict[str, list[Watched]],
                 now: float) -> list[HeldLease]:
    now_ms = int(time.time() * 1000)
    renewed: list[HeldLease] = []
    for key, group in by_key.items():
        due = [call.lease for call in group if call.lease.due <= now]
        if due:
            pipe.zadd(key, {lease.token: now_ms + lease.ttl_ms for lease in due}, xx=True)
            for lease in due:
                if lease.also:
                    pipe.zadd(lease.also, {lease.token: now_ms + lease.ttl_ms}, xx=True)
            renewed += due
    return renewed


_the_keeper: Keeper | None = None
_keeper_lock = threading.Lock()


def keeper() -> Keeper:
    """This process's keeper (a new one in a forked child: the parent's leases are not its own)."""
    global _the_keeper
    with _keeper_lock:
        if _the_keeper is None or not _the_keeper.is_alive() or _the_keeper.pid != os.getpid():
            _the_keeper = Keeper()
            _the_keeper.start()
        return _the_keeper
