"""HTTP calls that another thread can abort, and the per-process monitor that does so.

Each call opens its own connection, so aborting it closes exactly that socket and the server
sees a disconnect (vLLM and SGLang then abort the sequence). One monitor thread per process
watches every open call: it aborts on ``should_stop()``, on the call's deadline, and when the
call's in-flight lease disappeared from Redis (the backend was drained with ``abort``, removed,
or the lease lapsed); and it renews the leases that are still held.

Its Redis traffic does not grow with the number of calls: every ``LEASE_CHECK_S`` one
``ZMSCORE`` per backend asks which of its leases are still there, and a third of a lease's expiry
after it was taken or last renewed one ``ZADD XX`` per backend renews all that are due (``XX``
never brings back a lease withdrawn meanwhile).
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import redis

log = logging.getLogger(__name__)

TICK_S = 0.1          # deadline checks
STOP_CHECK_S = 0.25   # should_stop() polls
LEASE_CHECK_S = 0.5   # lease renewals / abort detection
CONNECT_TIMEOUT_S = 10.0



class CallAborted(Exception):
    """The call was aborted on purpose; ``reason`` is cancelled | timeout | lost."""

    def __init__(self, reason: str):
        super().__init__(f"call aborted: {reason}")
        self.reason = reason


class HeldLease:
    """An in-flight lease: ``token`` in the sorted set ``key`` with an expiry score in ms."""

    def __init__(self, client: redis.Redis, key: str, token: str, ttl_s: float):
        self.redis, self.key, self.token, self.ttl_ms = client, key, token, int(ttl_s * 1000)
        self.due = time.monotonic() + ttl_s / 3
        """When the monitor renews it next (monotonic seconds)."""


class Call:
    """One HTTP exchange, abortable from another thread."""

    def __init__(self, timeout_s: float, should_stop: Callable[[], bool] | None = None,
                 lease: HeldLease | None = None):
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.should_stop = should_stop
        self.lease = lease
        self.reason: str | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def attach(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            if self.reason is not None:
                _shutdown(sock)

    def abort(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
            _shutdown(self._sock)

    def check(self) -> None:
        if self.reason is not None:
            raise CallAborted(self.reason)

    def __enter__(self) -> "Call":
        _monitor().add(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _monitor().remove(self)


def _shutdown(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def request_json(call: Call, method: str, url: str, body: Any = None,
                 headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """Send ``body`` as JSON and return (status, parsed body or text). Raises :class:`CallAborted`
    when the call was aborted, OSError / http.client errors when the connection failed."""
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    remaining = max(call.deadline - time.monotonic(), 0.01)
    conn = cls(parts.hostname, parts.port, timeout=min(remaining, CONNECT_TIMEOUT_S))
    payload = None if body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", "Connection": "close", **(headers or {})}
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        call.check()
        conn.connect()
        conn.sock.settimeout(remaining + 1.0)  # the monitor enforces the deadline; this is a backstop
        call.attach(conn.sock)
        conn.request(method, path or "/", body=payload, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        call.check()
    except (OSError, http.client.HTTPException):
        call.check()  # an abort closed the socket: report the abort, not the socket error
        raise
    finally:
        call.attach(None)
        conn.close()
    try:
        return resp.status, json.loads(data) if data else None
    except ValueError:
        return resp.status, data.decode(errors="replace")


class _Monitor(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="llm-call-monitor", daemon=True)
        self.calls: set[Call] = set()
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def add(self, call: Call) -> None:
        with self.lock:
            self.calls.add(call)

    def remove(self, call: Call) -> None:
        with self.lock:
            self.calls.discard(call)

    def run(self) -> None:
        last_stop = last_lease = 0.0
        while True:
            time.sleep(TICK_S)
            with self.lock:
                calls = list(self.calls)
            now = time.monotonic()
            try:
                for call in calls:
                    if now >= call.deadline:
                        call.abort("timeout")
                if now - last_stop >= STOP_CHECK_S:
                    last_stop = now
                    self._check_stops(calls)
                if now - last_lease >= LEASE_CHECK_S:
                    last_lease = now
                    self._renew(calls)
            except Exception:  # noqa: BLE001 - the monitor must outlive any one bad pass
                log.exception("LLM call monitor pass failed")

    @staticmethod
    def _check_stops(calls: list[Call]) -> None:
        for call in calls:
            try:
                if call.should_stop is not None and call.should_stop():
                    call.abort("cancelled")
            except Exception:  # noqa: BLE001 - a broken callback must not kill the monitor
                log.exception("should_stop() raised; treating the call as cancelled")
                call.abort("cancelled")

    @staticmethod
    def _renew(calls: list[Call]) -> None:
        """Abort the calls whose lease is gone; renew the others' that are due. One ``ZMSCORE``
        and at most one ``ZADD`` per lease set, in one round trip per Redis client."""
        held = [call for call in calls if call.lease is not None and call.reason is None]
        by_client: dict[int, list[Call]] = {}
        for call in held:
            by_client.setdefault(id(call.lease.redis), []).append(call)
        for group in by_client.values():
            try:
                _check_and_renew(group)
            except redis.RedisError as exc:
                log.warning("in-flight lease renewal failed: %s", exc)


def _check_and_renew(calls: list[Call]) -> None:
    by_key: dict[str, list[Call]] = {}
    for call in calls:
        by_key.setdefault(call.lease.key, []).append(call)
    now, now_ms = time.monotonic(), int(time.time() * 1000)
    pipe = calls[0].lease.redis.pipeline(transaction=False)
    for key, group in by_key.items():
        pipe.zmscore(key, [call.lease.token for call in group])
    renewals = []
    for key, group in by_key.items():
        due = [call.lease for call in group if call.lease.due <= now]
        if due:
            pipe.zadd(key, {lease.token: now_ms + lease.ttl_ms for lease in due}, xx=True)
            renewals += due
    replies = pipe.execute()
    for group, scores in zip(by_key.values(), replies):
        for call, score in zip(group, scores):
            if score is None:
                call.abort("lost")
    for lease in renewals:
        lease.due = now + lease.ttl_ms / 3000


_the_monitor: _Monitor | None = None
_monitor_lock = threading.Lock()


def _monitor() -> _Monitor:
    global _the_monitor
    with _monitor_lock:
        if _the_monitor is None or not _the_monitor.is_alive() or _the_monitor.pid != os.getpid():
            _the_monitor = _Monitor()
            _the_monitor.start()
        return _the_monitor
