"""Leases: Redis keys with an expiry that their holder renews while it lives.

One renewal thread per process keeps every lease the process holds; when the process dies the
keys lapse, which is how the sweep learns that a stage's worker is gone. The leases due at once
are renewed in one pipelined round trip per Redis client.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid

import redis

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Lease:
    def __init__(self, client: redis.Redis, key: str, ttl_s: float, owner: str = ""):
        self.redis = client
        self.key = key
        self.ttl_ms = max(int(ttl_s * 1000), 100)
        self.token = f"{owner}:{uuid.uuid4().hex}"
        self.due = 0.0
        """When the keeper renews it next (monotonic seconds)."""

    def acquire(self) -> bool:
        if not self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms):
            return False
        _keeper().hold(self)
        return True

    def renew(self) -> bool:
        return bool(self.redis.eval(_RENEW, 1, self.key, self.token, self.ttl_ms))

    def release(self) -> None:
        _keeper().drop(self)
        try:
            self.redis.eval(_RELEASE, 1, self.key, self.token)
        except redis.RedisError:
            log.warning("could not release lease %s; it will lapse", self.key)


class _Keeper(threading.Thread):
    """Renews each held lease a third of its expiry after it was taken or last renewed.

    Only leases that are due are renewed: a stage that starts does not make the keeper touch
    the hundreds of others a busy worker holds."""

    def __init__(self) -> None:
        super().__init__(name="lease-keeper", daemon=True)
        self.leases: dict[str, Lease] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.next_due = float("inf")

    def hold(self, lease: Lease) -> None:
        lease.due = time.monotonic() + lease.ttl_ms / 3000
        with self.lock:
            self.leases[lease.token] = lease
            earlier = lease.due < self.next_due
        if earlier:
            self.wake.set()

    def drop(self, lease: Lease) -> None:
        with self.lock:
            self.leases.pop(lease.token, None)

    def run(self) -> None:
        while True:
            now = time.monotonic()
            with self.lock:
                due = [lease for lease in self.leases.values() if lease.due <= now]
            for lease in due:
                lease.due = now + lease.ttl_ms / 3000
            self._renew(due)
            with self.lock:
                self.next_due = min((lease.due for lease in self.leases.values()), default=now + 1.0)
            self.wake.wait(max(self.next_due - time.monotonic(), 0.0))
            self.wake.clear()

    def _renew(self, due: list[Lease]) -> None:
        by_client: dict[int, list[Lease]] = {}
        for lease in due:
            by_client.setdefault(id(lease.redis), []).append(lease)
        for group in by_client.values():
            try:
                pipe = group[0].redis.pipeline(transaction=False)
                for lease in group:
                    pipe.eval(_RENEW, 1, lease.key, lease.token, lease.ttl_ms)
                held = pipe.execute()
            except redis.RedisError as exc:
                log.warning("lease renewal failed: %s", exc)
                continue
            for lease, ok in zip(group, held):
                if not ok and lease.token in self.leases:  # not merely released meanwhile
                    log.warning("lease %s was lost before renewal", lease.key)


_the_keeper: _Keeper | None = None
_keeper_lock = threading.Lock()


def _keeper() -> _Keeper:
    global _the_keeper
    with _keeper_lock:
        if _the_keeper is None or not _the_keeper.is_alive():
            _the_keeper = _Keeper()
            _the_keeper.start()
        return _the_keeper
