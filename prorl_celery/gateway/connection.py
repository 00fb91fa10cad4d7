"""One connection to a session's gateway (:mod:`prorl_celery.gateway.serving`), owned by one
thread at a time.

The event loop owns it while it waits for a request: it reads it into the request reader, and
a refused request is answered there. A whole request hands it to one of the session's call
threads (*held*; the loop no longer watches it), which serves it, writes the answer straight to
the socket, serves what was pipelined behind it in order, and waits up to ``NEXT_S`` on the
socket for the caller's next request (a harness's calls come back to back: the thread that
answered reads the next one, with no hand-over between threads on the call's path). Then it
hands the connection back to the loop, which also finishes an answer the socket could not take
at once. After a refusal the connection *lingers* a moment, dropping what of the body was already
on its way (so the peer reads the refusal rather than a reset), and closes. Only the loop closes
a socket, and never one a call thread holds (it shuts that one down: the thread then gives up)."""
from __future__ import annotations

import select
import selectors
import socket
import time
from typing import Any

from prorl_celery.gateway.framing import Refusal, RequestReader

READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
RECV = 65536
LINGER_BYTES = 1 << 20  # after a refusal, what of a body already on its way is read and dropped
NEXT_S = 0.05  # a call thread's wait on its connection for the next request before handing it back


class Connection:
    def __init__(self, serving: Any, sock: socket.socket):
        self.serving, self.sock, self.loop = serving, sock, serving.loop
        self.reader = RequestReader(serving.host.authorize, serving.reserve, serving.release)
        self.held = self.closed = self.disposed = self.lingering = self.ending = False
        self.out: bytes | memoryview = b""
        self.keep = True
        self.linger_left = 0
        self.since = time.monotonic()  # when the current state began (idle, head, body, write, linger)
        self._poll: Any = None
        self.loop.register(sock, READ, self.on_event)

    # -- the loop's side ------------------------------------------------------------------

    def on_event(self, mask: int) -> None:
        if mask & WRITE:
            self._write_more()
        elif mask & READ:
            self._read()

    def _read(self) -> None:
        data = self._recv()
        if data is None:
            return
        if self.lingering:
            self.linger_left -= len(data)
            if not data or self.linger_left <= 0:
                self.close()
        elif not data:
            self.close()
        elif self._feed(data):
            self._hand_over()

    def _hand_over(self) -> None:
        self.held = True
        self.loop.modify(self.sock, 0, self.on_event)
        self.serving.dispatch(self)

    def _back(self) -> None:
        """The call thread gave the connection back (or, with ``out``, the rest of an answer)."""
        if self.disposed:
            return
        if self.closed or self.ending and not self.out:
            self.close()
        elif self.out:
            self.loop.modify(self.sock, WRITE, self.on_event)
        else:
            self.loop.modify(self.sock, READ, self.on_event)

    def _write_more(self) -> None:
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        self.out = self.out[sent:]
        if not self.out:
            self.out, self.since = b"", time.monotonic()
            if self.ending:
                self.close()
            else:
                self.loop.modify(self.sock, READ, self.on_event)

    def expired(self, now: float) -> bool:
        limits = self.serving.limits
        if self.held:
            return False  # a call runs as long as its budget; its thread hands the connection back
        if self.lingering:
            limit = limits.linger_s
        elif self.out:
            limit = limits.write_s
        elif self.reader.in_body:
            limit = limits.body_s
        elif self.reader.started:
            limit = limits.head_s
        else:
            limit = limits.idle_s
        return now - self.since > limit

    def close(self) -> None:
        """On the loop's thread: a held connection is shut down (its thread gives it back and it
        is closed then), any other closed now."""
        if self.disposed:
            return
        self.closed = True
        if self.held:
            _shutdown(self.sock, socket.SHUT_RDWR)
            return
        self.disposed = True
        self.loop.unregister(self.sock)
        self.sock.close()
        self.reader.abandon()
        self.serving.conns.discard(self)

    # -- a call thread's side (while held) --------------------------------------------------

    def serve(self) -> None:
        """Serve the waiting requests, then the next ones that come at once; then give it back."""
        try:
            while not self.closed and self.reader.ready:
                self.serving.call(self, self.reader.ready.popleft())
                if self.closed or self.ending or self.out or self.lingering:
                    break
                if not self.reader.ready:
                    self._await_next()
        finally:
            self.held = False
            self.loop.call_soon(self._back)

    def finish(self, data: bytes | None, keep: bool) -> None:
        """The answer (None: none, close) to the request being served."""
        self.keep = keep
        if data is None or self.closed:
            self.ending = True
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.ending = True
            return
        self.since = time.monotonic()
        if sent < len(data):
            self.out = memoryview(data)[sent:]  # the loop writes the rest once it is handed back
        self.ending = not keep

    def _await_next(self) -> None:
        """Read what comes within ``NEXT_S``: until a request is whole, or nothing more comes."""
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self.sock, select.POLLIN)
        deadline = time.monotonic() + NEXT_S
        while not self.closed:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(left * 1000):
                return
            data = self._recv()
            if data is None:
                continue
            if not data:
                self.ending = True
                return
            if self._feed(data) or self.lingering:
                return

    # -- either side (whichever holds it) ---------------------------------------------------

    def _recv(self) -> bytes | None:
        """What arrived (b"": the end), None when nothing did."""
        try:
            return self.sock.recv(RECV)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""

    def _feed(self, data: bytes) -> bool:
        """Read ``data``; whether a request is whole. A refusal is answered here."""
        reader = self.reader
        state = (reader.started, reader.in_body)
        try:
            reader.feed(data)
        except Refusal as refusal:
            self._refuse(refusal)
            return False
        if (reader.started, reader.in_body) != state:
            self.since = time.monotonic()
        if reader.expect_continue:
            reader.expect_continue = False
            self._send_small(b"HTTP/1.1 100 Continue\r\n\r\n")
        return bool(reader.ready)

    def _refuse(self, refusal: Refusal) -> None:
        """Answer, stop sending, and linger: what comes is read and dropped, then it closes."""
        self._send_small(self.serving.host.refusal(refusal)[1])
        _shutdown(self.sock, socket.SHUT_WR)
        self.reader.abandon()
        self.lingering, self.linger_left, self.since = True, LINGER_BYTES, time.monotonic()

    def _send_small(self, data: bytes) -> None:
        try:
            self.sock.send(data)
        except OSError:
            pass


def _shutdown(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass
