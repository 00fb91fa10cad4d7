"""One connection to a session's gateway, on the event loop (:mod:`prorl_celery.gateway.serving`).

The loop reads it into its request reader; a whole request goes to the session's call threads
(``serving.dispatch``) and the connection is *busy* until the call thread's :meth:`finish`
wrote the answer (straight to the socket; the loop finishes a write the socket could not take
at once). While busy, a pipelined request waits in the reader and the socket is no longer read
(*paused*). A refused request is answered, then the connection *lingers* a moment, dropping
what of its body was already on the way (so the peer reads the refusal rather than a reset),
and closes. The lock orders the loop's and the call thread's moves; only the loop's thread
touches the selector, and the socket is closed only once no call thread holds it."""
from __future__ import annotations

import selectors
import socket
import threading
import time
from typing import Any

from prorl_celery.gateway.framing import Refusal, RequestReader

READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
RECV = 65536
LINGER_BYTES = 1 << 20  # after a refusal, what of a body already on its way is read and dropped


class Connection:
    def __init__(self, serving: Any, sock: socket.socket):
        self.serving, self.sock, self.loop = serving, sock, serving.loop
        self.reader = RequestReader(serving.host.authorize, serving.reserve, serving.release)
        self.lock = threading.RLock()  # a dispatch that fails finishes under it
        self.busy = self.paused = self.closed = self.disposed = self.lingering = self.eof = False
        self.out: bytes | memoryview = b""
        self.keep = True
        self.linger_left = 0
        self.since = time.monotonic()  # when the current state began (idle, head, body, write)
        self.loop.register(sock, READ, self.on_event)

    def on_event(self, mask: int) -> None:
        if mask & WRITE:
            self._write_more()
        elif mask & READ:
            self._read()

    def _read(self) -> None:
        try:
            data = self.sock.recv(RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if self.lingering:
            self.linger_left -= len(data)
            if not data or self.linger_left <= 0:
                self.close()
            return
        if not data:
            with self.lock:
                if self.busy:  # the peer sent all it will: answer what it asked, then close
                    self.eof = True
                    self.loop.modify(self.sock, 0, self.on_event)
                    return
            self.close()
            return
        reader = self.reader
        state = (reader.started, reader.in_body)
        try:
            reader.feed(data)
        except Refusal as refusal:
            self._refuse(refusal)
            return
        if (reader.started, reader.in_body) != state:
            self.since = time.monotonic()
        if reader.expect_continue:
            reader.expect_continue = False
            self._send_small(b"HTTP/1.1 100 Continue\r\n\r\n")
        if reader.ready:
            self._next()

    def _next(self) -> None:
        with self.lock:
            if not self.reader.ready:  # a call thread that finished took it already
                return
            if self.busy:  # pipelined behind the request being served: wait, and read no more
                if not self.paused:
                    self.paused = True
                    self.loop.modify(self.sock, 0, self.on_event)
                return
            self.busy = True
            self.serving.dispatch(self, self.reader.ready.popleft())

    def finish(self, data: bytes | None, keep: bool) -> None:
        """The answer (None: none, close), from the call thread that served the request. Sent
        outside the lock: while busy only this thread writes, and the loop closes no busy socket."""
        if data is not None and not self.closed:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                data = None
        with self.lock:
            if self.closed or data is None:
                self._drop()
            elif sent < len(data):
                self.out, self.keep, self.since = memoryview(data)[sent:], keep, time.monotonic()
                self.loop.call_soon(self._want_write)
            else:
                self._answered(keep)

    def _answered(self, keep: bool) -> None:  # under the lock, the answer written whole
        if not keep:
            self._drop()
            return
        self.since = time.monotonic()
        if self.reader.ready:  # the next pipelined request, in order
            self.serving.dispatch(self, self.reader.ready.popleft())
            return
        if self.eof:
            self._drop()
            return
        self.busy = False
        if self.paused:
            self.loop.call_soon(self._resume)

    def _drop(self) -> None:  # under the lock: no more on this connection
        self.busy = False
        self.closed = True
        self.loop.call_soon(self.close)

    def _resume(self) -> None:
        with self.lock:
            if self.paused and not self.busy and not self.closed:
                self.paused = False
                self.loop.modify(self.sock, READ, self.on_event)
        if self.reader.ready:
            self._next()

    def _want_write(self) -> None:
        with self.lock:
            if not self.closed:
                self.loop.modify(self.sock, WRITE, self.on_event)

    def _write_more(self) -> None:
        with self.lock:
            try:
                sent = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop()
                return
            self.out = self.out[sent:]
            if self.out:
                return
            self.out = b""
            self.loop.modify(self.sock, 0 if self.paused or self.eof else READ, self.on_event)
            self._answered(self.keep)

    def _send_small(self, data: bytes) -> None:
        try:
            self.sock.send(data)
        except OSError:
            pass

    def _refuse(self, refusal: Refusal) -> None:
        """Answer the refusal and linger, or (behind a request being served) just close."""
        _, data = self.serving.host.refusal(refusal)
        with self.lock:
            if not self.busy:
                self._send_small(data)
                try:
                    self.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self.lingering, self.linger_left, self.since = True, LINGER_BYTES, time.monotonic()
        self.reader.abandon()
        if not self.lingering:
            self.close()

    def expired(self, now: float) -> bool:
        limits = self.serving.limits
        if self.lingering:
            limit = limits.linger_s
        elif self.busy:
            limit = limits.write_s if self.out else float("inf")  # a call runs as long as its budget
        elif self.reader.in_body:
            limit = limits.body_s
        elif self.reader.started:
            limit = limits.head_s
        else:
            limit = limits.idle_s
        return now - self.since > limit

    def close(self) -> None:
        """On the loop's thread. A call thread holding the connection closes it when it finishes
        (the descriptor must not be reused under it); the peer hears of it at once."""
        with self.lock:
            if self.disposed:
                return
            self.closed = True
            self.loop.unregister(self.sock)
            if self.busy and not self.out:  # not once it handed the rest of its answer to the loop
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            self.disposed = True
        self.sock.close()
        self.reader.abandon()
        self.serving.conns.discard(self)
