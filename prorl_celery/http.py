"""The one HTTP client for the service's own outgoing calls: sandbox hosts, LLM backends, probes.

``requests`` costs about 0.8 ms of CPU per call on the caller's side (0.2 ms with
``http.client``), and a new TCP connection per call adds a connect and a slow-start. One
keep-alive connection per thread and (scheme, host, port), reused. A connection the peer closed
while idle is noticed before reuse (as urllib3 does). The race left (the peer closes just as a
request goes out) is retried once on a new connection, only for idempotent methods: a POST
(an LLM generate, a sandbox exec) may already have reached the server, so it is never sent twice;
it does not reuse a connection idle longer than ``SAFE_IDLE_S`` either, so that race stays rare.

``on_socket`` lets another thread abort a call: it is given the socket before the request goes
out and ``None`` after the answer was read; shutting that socket down ends the call at once.
"""
from __future__ import annotations

import http.client
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any
from urllib.parse import urlencode, urlsplit

from prorl_celery import jsonfast

IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
# A request that cannot be resent does not go out on a connection idle longer than this: uvicorn
# (vLLM, SGLang) and llama.cpp close idle ones after 5 s, and one closing as the request goes out
# would fail the request.
SAFE_IDLE_S = 4.0
# Raised by a reused connection the peer closed as the request went out.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)

Key = tuple[str, str, int]
OnSocket = Callable[[socket.socket | None], None]
_local = threading.local()


class TransportError(OSError):
    """The peer could not be reached or dropped the connection."""


class Response:
    def __init__(self, raw: http.client.HTTPResponse, conn: http.client.HTTPConnection, stream: bool):
        self.status_code = raw.status
        self._raw, self._conn = raw, conn
        self._content = None if stream else raw.read()

    @property
    def ok(self) -> bool:
        return self.status_code < 400

    @property
    def content(self) -> bytes:
        if self._content is None:
            self._content = self._raw.read()
        return self._content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return jsonfast.loads(self.content)

    def iter_content(self, size: int = 1 << 16) -> Iterator[bytes]:
        while chunk := self._raw.read(size):
            yield chunk

    def iter_lines(self) -> Iterator[bytes]:
        """The body line by line, as it arrives (server-sent events), each with its newline."""
        while line := self._raw.readline():
            yield line

    def header(self, name: str) -> str | None:
        return self._raw.getheader(name)

    @property
    def sock(self) -> socket.socket | None:
        """The connection's socket, for a streamed body another thread may have to cut short."""
        return self._conn.sock

    def close(self) -> None:
        if not self._raw.isclosed():  # not read to the end: the connection cannot be reused
            self._conn.close()
        self._raw.close()

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _cork(sock: socket.socket, on: bool) -> None:
    """Hold (``on``) or flush the socket's partial segments (Linux ``TCP_CORK``): http.client
    writes the headers and the body in two sends, which would leave as two segments (the second
    wakes the server a second time). Corked while the request is written, they leave as one."""
    if _TCP_CORK is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, int(on))
        except OSError:  # not TCP (a test's socketpair), or the socket is already gone
            pass


_TCP_CORK = getattr(socket, "TCP_CORK", None)


def _key(url: str) -> tuple[Key, str]:
    parts = urlsplit(url)
    scheme = parts.scheme or "http"
    port = parts.port or (443 if scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (scheme, parts.hostname or "", port), path


def _conns() -> dict[Key, http.client.HTTPConnection]:
    pool = getattr(_local, "conns", None)
    if pool is None:
        pool = _local.conns = {}
    return pool


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """An idle keep-alive socket that is readable was closed (or spoke out of turn) by the peer."""
    if conn.sock is None:
        return True
    try:
        poller = select.poll()
        poller.register(conn.sock.fileno(), select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def _checkout(key: Key, connect_timeout: float, max_idle: float) -> tuple[http.client.HTTPConnection, bool]:
    """This thread's connection to ``key`` (a new one when it was idle over ``max_idle`` s) and
    whether it was reused."""
    pool = _conns()
    conn = pool.get(key)
    if conn is not None and time.monotonic() - conn.last_used <= max_idle and not _dropped(conn):
        return conn, True
    if conn is not None:
        conn.close()
    scheme, host, port = key
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = cls(host, port, timeout=connect_timeout)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as urllib3: no Nagle wait on a reused socket
    pool[key] = conn
    return conn, False


def _discard(key: Key) -> None:
    dead = _conns().pop(key, None)
    if dead is not None:
        dead.close()


def _length(body: IO[bytes]) -> int:
    here = body.tell()
    end = body.seek(0, os.SEEK_END)
    body.seek(here)
    return end - here


def _send(method: str, key: Key, path: str, headers: dict[str, str], data: Any, timeout: float,
          connect_timeout: float, stream: bool, on_socket: OnSocket | None) -> Response:
    retried, resendable = False, method in IDEMPOTENT and not hasattr(data, "read")
    while True:
        conn, reused = _checkout(key, connect_timeout, float("inf") if resendable else SAFE_IDLE_S)
        conn.last_used = time.monotonic()
        conn.sock.settimeout(timeout)
        if on_socket is not None:
            on_socket(conn.sock)
        try:
            sock = conn.sock
            _cork(sock, True)
            try:
                conn.request(method, path, body=data, headers=headers)
            finally:
                _cork(sock, False)
            response = Response(conn.getresponse(), conn, stream)
            conn.last_used = time.monotonic()
            return response
        except _STALE:
            _discard(key)
            if not reused or retried or not resendable:
                raise
            retried = True


def request(method: str, url: str, *, timeout: float, headers: dict[str, str] | None = None,
            params: dict[str, str] | None = None, data: bytes | str | IO[bytes] | None = None,
            stream: bool = False, connect_timeout: float | None = None,
            on_socket: OnSocket | None = None) -> Response:
    """One request on this thread's connection to ``url``'s host; TransportError if it failed.
    ``timeout`` bounds each socket operation, and the connect unless ``connect_timeout`` is less."""
    key, path = _key(url)
    if params:
        path += ("&" if "?" in path else "?") + urlencode(params)
    headers = dict(headers or {})
    if isinstance(data, str):
        data = data.encode()
    if data is not None:
        headers["Content-Length"] = str(len(data) if isinstance(data, bytes) else _length(data))
    try:
        return _send(method, key, path, headers, data, timeout,
                     min(connect_timeout or timeout, timeout), stream, on_socket)
    except (OSError, http.client.HTTPException) as exc:
        _discard(key)
        raise TransportError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        if on_socket is not None:
            on_socket(None)


def request_json(method: str, url: str, body: Any = None, *, timeout: float,
                 headers: dict[str, str] | None = None, connect_timeout: float | None = None,
                 on_socket: OnSocket | None = None) -> tuple[int, Any]:
    """Send ``body`` as JSON; (status, the parsed answer, its text when not JSON, None when empty)."""
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    payload = None if body is None else jsonfast.dumps(body)
    resp = request(method, url, timeout=timeout, headers=hdrs, data=payload,
                   connect_timeout=connect_timeout, on_socket=on_socket)
    try:
        return resp.status_code, resp.json() if resp.content else None
    except ValueError:
        return resp.status_code, resp.text


def route_source(host: str, port: int) -> str | None:
    """The local address a packet to ``host:port`` leaves from (a UDP ``connect`` sends nothing)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(address)
                return sock.getsockname()[0]
        except OSError:
            continue
    return None
