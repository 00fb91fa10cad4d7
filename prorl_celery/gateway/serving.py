"""A gateway session's connections on the process's event loop (:mod:`prorl_celery.netloop`).

Each connection is read by the loop into its :class:`~prorl_celery.gateway.framing.RequestReader`
(credential from the head before any body, caps on the head, the body and the session's bytes in
flight); a whole request hands the connection to one of the session's bounded pool of call
threads, which serves it and what follows at once (:mod:`prorl_celery.gateway.connection`). One
request of a connection is served at a time, in order.

Caps (:class:`Limits`): connections per session; on the relay listener (the worker's routable
address) connections not yet through the handshake, per peer address and in all; deadlines on
the handshake, the head, the body, an idle connection and an answer the peer does not read."""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from prorl_celery import handshake, jsonfast
from prorl_celery.gateway.connection import Connection
from prorl_celery.gateway.framing import MAX_BODY, Headers, Refusal, Request
from prorl_celery.netloop import CallPool, Loop

log = logging.getLogger(__name__)
READ = selectors.EVENT_READ
BACKLOG = socket.SOMAXCONN  # the kernel's own cap (4096): a burst of connections waits, is not refused


@dataclass
class Limits:
    """The bounds of one session's connections (seconds, counts, bytes)."""

    connections: int = 64
    pending_per_peer: int = 8  # the relay listener: connections before their handshake, per address
    pending: int = 64  # ... and in all
    handshake_s: float = 5.0
    head_s: float = 15.0
    body_s: float = 60.0
    idle_s: float = 300.0  # a harness's tool may run minutes between its calls
    write_s: float = 60.0
    linger_s: float = 2.0
    call_threads: int = 8
    inflight_bytes: int = 2 * MAX_BODY


class Host(Protocol):
    """What the connections serve: the :class:`~prorl_celery.gateway.server.Gateway`."""

    def authorize(self, method: str, path: str, headers: Headers) -> Refusal | None: ...

    def serve(self, exchange: "Exchange") -> None: ...

    def refusal(self, refusal: Refusal) -> tuple[int, bytes]: ...


class Exchange:
    """One request and the way to answer it (exactly once: :meth:`send`)."""

    def __init__(self, conn: "Connection", request: Request):
        self.conn, self.request = conn, request
        self.headers, self.sent = request.headers, False

    def json(self, status: int, body: Any) -> None:
        self.send(status, "application/json", jsonfast.dumps(body))

    def events(self, chunks: Any) -> None:
        """The dialect's server-sent events. The turn is whole before the first event, so they go
        in one write with their length, and the connection stays open for the next call (a
        harness that streams every call would otherwise connect anew each time)."""
        self.send(200, "text/event-stream", b"".join(chunks), extra="Cache-Control: no-cache\r\n")

    def send(self, status: int, content_type: str, data: bytes, extra: str = "") -> None:
        """Status line, headers and body in one write."""
        self.sent = True
        self.conn.finish(response(status, content_type, data, extra, self.request.keep_alive),
                         self.request.keep_alive)


def response(status: int, content_type: str, data: bytes, extra: str = "", keep_alive: bool = True) -> bytes:
    close = "" if keep_alive else "Connection: close\r\n"
    head = (f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(data)}\r\n{extra}{close}\r\n")
    return head.encode("latin-1") + data


REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           408: "Request Timeout", 413: "Content Too Large", 429: "Too Many Requests",
           431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable",
           504: "Gateway Timeout"}


class Serving:
    """The listeners and connections of one session, its call threads and its byte budget."""

    def __init__(self, host: Host, name: str, limits: Limits | None = None):
        self.host, self.name = host, name
        self.limits = limits or Limits()
        self.loop = Loop.shared("gateway")
        self.calls = CallPool(self.limits.call_threads, f"gateway-{name}")
        self.listeners: list[Listener] = []
        self.conns: set[Connection] = set()
        self.handshakes: set[Handshake] = set()
        self._inflight = 0
        self._lock = threading.Lock()
        self._closed = False

    def listen(self, sock: socket.socket, relay_key: bytes | None = None) -> None:
        """Serve ``sock`` (bound, not yet listening); ``relay_key``: the relay's handshake first."""
        sock.listen(BACKLOG)
        sock.setblocking(False)
        self.listeners.append(Listener(self, sock, relay_key))

    def start(self) -> None:
        def begin() -> None:
            for listener in self.listeners:
                self.loop.register(listener.sock, READ, listener.on_accept)
            self.loop.add_sweep(self.sweep)
        self.loop.call_and_wait(begin)

    def close(self) -> None:
        """Stop accepting, close every connection (their calls were aborted by the session)."""
        def end() -> None:
            self._closed = True
            self.loop.remove_sweep(self.sweep)
            for listener in self.listeners:
                self.loop.unregister(listener.sock)
                listener.sock.close()
            for pending in list(self.handshakes):
                pending.close()
            for conn in list(self.conns):
                conn.close()
        self.loop.call_and_wait(end)
        self.calls.shutdown()

    # the session's bytes of bodies in flight
    def reserve(self, n: int) -> bool:
        with self._lock:
            if self._inflight + n > self.limits.inflight_bytes:
                return False
            self._inflight += n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self._inflight -= n

    def admit(self, sock: socket.socket) -> None:
        """A connection through its listener (and handshake): served, or refused over the cap."""
        if self._closed or len(self.conns) >= self.limits.connections:
            _refuse_now(sock, self.host.refusal(Refusal(
                503, "unavailable", f"this session has {self.limits.connections} connections open already")))
            return
        self.conns.add(Connection(self, sock))

    def dispatch(self, conn: Connection) -> None:
        """A connection with a whole request, to a call thread (:meth:`Connection.serve`)."""
        try:
            self.calls.submit(conn.serve)
        except RuntimeError:  # shut down: the session is closing
            conn.held = False
            conn.close()

    def call(self, conn: Connection, request: Request) -> None:
        """Serve one request on the calling thread; an answer is always sent (or the connection
        ends)."""
        exchange = Exchange(conn, request)
        try:
            self.host.serve(exchange)
        except Exception:  # noqa: BLE001 - the host answers its own failures; this is a bug's net
            log.exception("gateway %s: serving a request failed", self.name)
        finally:
            request.done()
            if not exchange.sent:
                conn.finish(None, False)

    def sweep(self, now: float) -> None:
        for item in [*self.handshakes, *self.conns]:
            if item.expired(now):
                item.close()


class Listener:
    """A listening socket: accepts, and hands each connection on (through the handshake when
    ``relay_key``), within the caps on connections not yet authenticated."""

    def __init__(self, serving: Serving, sock: socket.socket, relay_key: bytes | None):
        self.serving, self.sock, self.relay_key = serving, sock, relay_key
        self.tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
        self.pending: dict[str, int] = {}

    def on_accept(self, mask: int) -> None:
        for _ in range(64):  # a burst, then the loop's other sockets get their turn
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the listener rests until the next sweep
                log.warning("gateway %s: accept failed: %s", self.serving.name, exc)
                self.serving.loop.unregister(self.sock)
                self.serving.loop.add_sweep(self._resume)
                return
            sock.setblocking(False)
            if self.tcp:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.relay_key is None:
                self.serving.admit(sock)
            else:
                self._handshake(sock, addr[0])

    def _resume(self, now: float) -> None:
        self.serving.loop.remove_sweep(self._resume)
        if not self.serving._closed:
            self.serving.loop.modify(self.sock, READ, self.on_accept)

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        limits = self.serving.limits
        if self.pending.get(peer, 0) >= limits.pending_per_peer or sum(self.pending.values()) >= limits.pending:
            log.warning("gateway %s: relay listener: too many connections from %s before their handshake",
                        self.serving.name, peer)
            sock.close()
            return
        self.pending[peer] = self.pending.get(peer, 0) + 1
        Handshake(self, sock, peer)

    def done(self, peer: str) -> None:
        left = self.pending.get(peer, 1) - 1
        if left > 0:
            self.pending[peer] = left
        else:
            self.pending.pop(peer, None)


class Handshake:
    """A relay connection before its proof (:mod:`prorl_celery.handshake`): nothing past its
    64-byte answer is read until it proved it holds the session's relay key."""

    def __init__(self, listener: Listener, sock: socket.socket, peer: str):
        self.listener, self.sock, self.peer = listener, sock, peer
        self.loop = listener.serving.loop
        self.since = time.monotonic()
        self.got = b""
        listener.serving.handshakes.add(self)
        opening, self.nonce = handshake.challenge()
        try:
            sock.send(opening)  # 46 bytes on a fresh socket: its buffer takes them
        except OSError:
            self.close()
            return
        self.loop.register(sock, READ, self.on_event)

    def on_event(self, mask: int) -> None:
        try:
            data = self.sock.recv(handshake.ANSWER - len(self.got))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self.got += data
        if not data or len(self.got) < handshake.ANSWER:
            if not data:
                self.close()
            return
        proof = handshake.check_answer(self.listener.relay_key or b"", self.nonce, self.got)
        if proof is None:
            log.warning("gateway %s: relay listener: a wrong handshake from %s", self.listener.serving.name, self.peer)
            self.close()
            return
        self._forget()
        self.loop.unregister(self.sock)
        try:
            self.sock.send(proof)
        except OSError:
            self.sock.close()
            return
        self.listener.serving.admit(self.sock)

    def expired(self, now: float) -> bool:
        return now - self.since > self.listener.serving.limits.handshake_s

    def _forget(self) -> None:
        if self in self.listener.serving.handshakes:
            self.listener.serving.handshakes.discard(self)
            self.listener.done(self.peer)

    def close(self) -> None:
        self._forget()
        self.loop.unregister(self.sock)
        self.sock.close()


def _refuse_now(sock: socket.socket, answer: tuple[int, bytes]) -> None:
    try:
        sock.send(answer[1])
    except OSError:
        pass
    sock.close()

