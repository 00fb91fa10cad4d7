"""LLM calls that another thread can abort.

A call is one HTTP exchange on this thread's keep-alive connection to the backend
(:mod:`prorl_celery.http`); while it is open the socket is attached to the :class:`Call`, so
aborting it shuts exactly that socket down and the server sees a disconnect (vLLM and SGLang
then abort the sequence); the connection is then dropped, never reused. The process's lease
keeper (:mod:`prorl_celery.leases`) watches every open call: it aborts on ``should_stop()``, on
the call's deadline, and when the call's in-flight lease disappeared from Redis (the backend
was drained with ``abort``, removed, or the lease lapsed), and renews the leases still held.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from prorl_celery import http, jsonfast
from prorl_celery.leases import HeldLease, keeper

__all__ = ["Call", "CallAborted", "HeldLease", "open_stream", "request_json"]

log = logging.getLogger(__name__)

STOP_CHECK_S = 0.25   # should_stop() polls
CONNECT_TIMEOUT_S = 10.0


class CallAborted(Exception):
    """The call was aborted on purpose; ``reason`` is cancelled | timeout | lost."""

    def __init__(self, reason: str):
        super().__init__(f"call aborted: {reason}")
        self.reason = reason


class Call:
    """One HTTP exchange, abortable from another thread (a :class:`~prorl_celery.leases.Watched`)."""

    def __init__(self, timeout_s: float, should_stop: Callable[[], bool] | None = None,
                 lease: HeldLease | None = None):
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.should_stop = should_stop
        self.lease = lease
        self.reason: str | None = None
        self._next_stop_check = 0.0
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

    def tick(self, now: float) -> None:
        if now >= self.deadline:
            self.abort("timeout")
        if self.should_stop is None or now < self._next_stop_check:
            return
        self._next_stop_check = now + STOP_CHECK_S
        try:
            if self.should_stop():
                self.abort("cancelled")
        except Exception:  # noqa: BLE001 - a broken callback must not stop the keeper
            log.exception("should_stop() raised; treating the call as cancelled")
            self.abort("cancelled")

    def lost(self) -> None:
        self.abort("lost")

    def __enter__(self) -> Call:
        keeper().watch(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        keeper().unwatch(self)


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
    when the call was aborted, OSError (:class:`prorl_celery.http.TransportError`) when the
    connection failed."""
    remaining = max(call.deadline - time.monotonic(), 0.01)
    call.check()
    try:
        answer = http.request_json(method, url, body, headers=headers, on_socket=call.attach,
                                   timeout=remaining + 1.0,  # the keeper enforces the deadline; a backstop
                                   connect_timeout=min(remaining, CONNECT_TIMEOUT_S))
    except OSError:
        call.check()  # an abort closed the socket: report the abort, not the socket error
        raise
    call.check()
    return answer


def open_stream(call: Call, url: str, body: Any, headers: dict[str, str] | None = None) -> http.Response:
    """POST ``body`` as JSON for a streamed answer: the response with its headers read and its
    socket still attached to ``call``, so an abort shuts the stream down while it is read (the
    caller reads it, calls ``call.check()`` when it ends early, and closes it). Raises as
    :func:`request_json`."""
    remaining = max(call.deadline - time.monotonic(), 0.01)
    call.check()
    try:
        resp = http.request("POST", url, timeout=remaining + 1.0, on_socket=call.attach,
                            headers={"Content-Type": "application/json", "Accept": "text/event-stream",
                                     **(headers or {})},
                            data=jsonfast.dumps(body), stream=True,
                            connect_timeout=min(remaining, CONNECT_TIMEOUT_S))
    except OSError:
        call.check()
        raise
    call.attach(resp.sock)
    return resp
