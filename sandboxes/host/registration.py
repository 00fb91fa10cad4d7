"""A sandbox host's registration in Redis: the hash placement reads (address, token, runtimes,
capacity, ``live``) under ``keys.host(host_id)``, and its heartbeat in the ``keys.hosts()``
sorted set; placement takes a host that missed three heartbeats (``host_heartbeat_s``) for dead."""
from __future__ import annotations

import logging
import threading
import time

import redis

from prorl_celery import keys
from sandboxes.host.pool import SandboxPool
from sandboxes.protocol import HostRecord

log = logging.getLogger(__name__)
# How long the live count's publisher gathers changes before it writes: a create and the close
# that follows it within this window cost no write at all, and a host writes the count at most
# 1 / PUBLISH_SETTLE_S times a second however fast its sandboxes come and go. Placement sees a
# change this much later, far within the heartbeat's period; a host it finds full says so.
PUBLISH_SETTLE_S = 0.05


class Registration:
    """The host's hash in Redis and its heartbeat in the ``keys.hosts()`` sorted set."""

    def __init__(self, client: redis.Redis, record: HostRecord, pool: SandboxPool, interval_s: float):
        self.client = client
        self.record = record
        self.pool = pool
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._publisher: threading.Thread | None = None
        self._published: int | None = None  # the live count last written (None: not known)

    def beat(self) -> None:
        now = time.time()
        self.record.live, self.record.heartbeat_at = self.pool.live, now
        key = keys.host(self.record.host_id)
        pipe = self.client.pipeline()
        pipe.hset(key, mapping=self.record.to_redis())
        pipe.expire(key, int(max(60, 10 * self.interval_s)))
        pipe.zadd(keys.hosts(), {self.record.host_id: now})
        pipe.execute()
        self._published = self.record.live

    def update_live(self) -> None:
        """Placement reads ``live``: publish it after a change, not only every heartbeat; by a
        thread of its own, so creates and closes do not wait for Redis. The changes of
        ``PUBLISH_SETTLE_S`` become one write, and none when the count is the one last written."""
        self._changed.set()

    def _publish_live(self) -> None:
        while True:
            self._changed.wait()
            if self._stop.wait(PUBLISH_SETTLE_S):
                return
            self._changed.clear()  # before the count is read: a later change comes round again
            live = self.pool.live
            if live == self._published:
                continue
            try:
                self.client.hset(keys.host(self.record.host_id), "live", live)
                self._published = live
            except redis.RedisError as exc:
                self._published = None
                log.warning("could not publish live count: %s", exc)

    def _beat_logged(self) -> None:
        try:
            self.beat()
        except redis.RedisError as exc:
            log.warning("heartbeat to redis failed: %s", exc)

    def start(self) -> threading.Thread:
        """Register now (so the host is placeable once it says ready), then keep beating."""
        self._beat_logged()

        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self._beat_logged()

        thread = threading.Thread(target=loop, name="sandbox-host-heartbeat", daemon=True)
        thread.start()
        self._publisher = threading.Thread(target=self._publish_live, name="sandbox-host-live",
                                           daemon=True)
        self._publisher.start()
        return thread

    def remove(self) -> None:
        self._stop.set()
        self._changed.set()
        if self._publisher is not None:
            self._publisher.join(timeout=5)  # its last write must not re-create the hash
        try:
            self.client.zrem(keys.hosts(), self.record.host_id)
            self.client.delete(keys.host(self.record.host_id))
        except redis.RedisError as exc:
            log.warning("could not remove registration: %s", exc)
