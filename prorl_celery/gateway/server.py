"""The session gateway's HTTP server: one per rollout session, on a loopback port or a unix
socket, answering only its session's credential.

Routes come from the API dialects (:mod:`prorl_celery.gateway.apis`) plus ``GET /v1/models``.
Every call is generated in full first (token mode has no partial answer worth sending early) and
then sent whole or as the dialect's server-sent events (in one write, with their length: the
connection stays open); a failure is sent in the caller's API's own error shape."""
from __future__ import annotations

import hmac
import logging
import os
import selectors
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prorl_celery import jsonfast
from prorl_celery.gateway.apis import load_all
from prorl_celery.gateway.apis.base import BadCall, Failure, failure_of
from prorl_celery.gateway.session import GatewaySession

log = logging.getLogger(__name__)
MAX_BODY = 64 * 1024 * 1024  # a 200k-token history with tools is a few MB


MAX_HEADERS = 100


class _Headers(dict):
    """A request's headers by lower-cased name (the last one of a repeated name)."""

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(name.lower(), default)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Serving"

    def parse_request(self) -> bool:
        """An HTTP/1.1 request line and its headers, read into a plain dict (http.server runs
        them through the email package's parser: a third of the gateway's own time per call).
        Anything else (HTTP/1.0, a malformed line) is left to http.server."""
        line = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        parts = line.split()
        if len(parts) != 3 or parts[2] != "HTTP/1.1":
            return super().parse_request()
        self.requestline = line
        self.command, self.path, self.request_version = parts
        headers = _Headers()
        while True:
            raw = self.rfile.readline(65537)
            if raw in (b"\r\n", b"\n", b""):
                break
            if len(raw) > 65536 or len(headers) >= MAX_HEADERS:
                self.close_connection = True
                self.send_error(431, "Request Header Fields Too Large")
                return False
            name, colon, value = raw.decode("iso-8859-1").partition(":")
            if not colon or not name.strip() or name[0] in " \t":  # no obsolete line folding either
                self.close_connection = True
                self.send_error(400, f"Bad header line {raw[:80]!r}")
                return False
            headers[name.strip().lower()] = value.strip()
        self.headers = headers  # type: ignore[assignment]
        self.close_connection = headers.get("connection", "").lower() == "close"
        if headers.get("expect", "").lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return True

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("gateway %s: " + fmt, self.server.gateway.session.session_id, *args)

    def address_string(self) -> str:  # a unix socket's peer has no address
        return str(self.client_address or "unix")

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        gateway = self.server.gateway
        path = self.path.split("?", 1)[0].rstrip("/")
        dialect, op = gateway.routes.get((method, path), (None, ""))
        raw = self._raw()  # read whatever the answer: the connection stays usable
        if not gateway.authorized(self.headers):
            self._json(*gateway.error_for(dialect, Failure(401, "auth", "missing or wrong session credential")))
            return
        if method == "GET" and path in ("/v1/models", "/models"):
            self._json(*gateway.models_answer())
            return
        if dialect is None:
            self._json(*gateway.error_for(None, Failure(404, "not_found", f"no route {method} {path}")))
            return
        try:
            body = jsonfast.loads(raw) if raw else None
        except ValueError:
            body = BadCall(Failure(400, "invalid_request", "the body is not JSON"))
        gateway.handle(self, dialect, op, body)

    def _raw(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._chunked()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(min(length, MAX_BODY)) if length else b""

    def _chunked(self) -> bytes:
        out = bytearray()
        while len(out) <= MAX_BODY:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                self.rfile.readline()
                break
            out += self.rfile.read(size)
            self.rfile.readline()
        return bytes(out)

    def _json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, "application/json", jsonfast.dumps(body))

    def _events(self, chunks) -> None:
        """The dialect's server-sent events. The turn is whole before the first event, so they go
        in one write with their length, and the connection stays open for the next call (a
        harness that streams every call would otherwise connect anew each time)."""
        self._send(200, "text/event-stream", b"".join(chunks), extra="Cache-Control: no-cache\r\n")

    def _send(self, status: int, content_type: str, data: bytes, extra: str = "") -> None:
        """Status line, headers and body in one write (http.server's send_response writes the
        headers apart and formats a Date header nobody reads)."""
        if log.isEnabledFor(logging.DEBUG):
            self.log_request(status, len(data))
        reason = self.responses.get(status, ("",))[0]
        close = "Connection: close\r\n" if self.close_connection else ""
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(data)}\r\n{extra}{close}\r\n")
        self.wfile.write(head.encode("latin-1") + data)


class _TCPHandler(_Handler):
    disable_nagle_algorithm = True  # no 40 ms delayed-ACK stall on a write that follows another


class _Serving:
    gateway: "Gateway"


class _TCPServer(_Serving, ThreadingHTTPServer):
    daemon_threads = True


class _UnixServer(_Serving, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class Gateway:
    """Serves one :class:`GatewaySession`. ``token`` is the session's credential (Bearer or
    ``x-api-key``); ``model`` the name ``/v1/models`` lists. Start with :meth:`start`; the
    harness's base URL is :attr:`url` (TCP) or the socket path (:attr:`socket_path`)."""

    def __init__(self, session: GatewaySession, token: str, model: str = "prorl-gateway",
                 host: str = "127.0.0.1", port: int = 0, socket_path: str | None = None):
        self.session, self.token, self.model = session, token, model
        self.routes = load_all()
        self.socket_path = socket_path
        if socket_path:
            self.httpd: Any = _UnixServer(socket_path, _Handler)
            os.chmod(socket_path, 0o666)  # the sandbox's uid connects; the token is the lock
        else:
            self.httpd = _TCPServer((host, port), _TCPHandler)
        self.httpd.gateway = self
        self.servers: list[Any] = [self.httpd]
        self._thread: threading.Thread | None = None
        self._closing = False

    def listen_tcp(self, host: str) -> str:
        """Also serve on TCP at ``host`` (a free port): the address a sandbox host on another node
        relays the session's socket to (:mod:`sandboxes.host.relay`). Before :meth:`start`.
        Returns ``host:port``."""
        assert self._thread is None, "listen_tcp() after start()"
        server = _TCPServer((host, 0), _TCPHandler)
        server.gateway = self
        self.servers.append(server)
        bound, port = server.server_address[:2]
        return f"[{bound}]:{port}" if ":" in bound else f"{bound}:{port}"

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "Gateway":
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name=f"gateway-{self.session.session_id}", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        """Accept connections until :meth:`close` (each one served by its own thread). Blocks
        without a timeout: http.server's serve_forever wakes every poll interval, which for a
        node's hundreds of idle sessions is thousands of wake-ups a second."""
        with selectors.DefaultSelector() as selector:
            for server in self.servers:
                selector.register(server, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._closing:
                for key, _ in selector.select():
                    if key.fileobj is not self._wake_r and not self._closing:
                        key.fileobj._handle_request_noblock()  # what serve_forever calls: accept, a thread

    def close(self) -> None:
        """Abort in-flight calls, stop serving, remove the socket."""
        self.session.cancel()
        self._closing = True
        thread, self._thread = self._thread, None
        if thread is not None:
            os.write(self._wake_w, b"x")
            thread.join(10)
            os.close(self._wake_r)
            os.close(self._wake_w)
        for server in self.servers:
            server.server_close()
        if self.socket_path and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def __enter__(self) -> "Gateway":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def authorized(self, headers: Any) -> bool:
        given = headers.get("x-api-key") or ""
        auth = headers.get("Authorization") or ""
        if auth.lower().startswith("bearer "):
            given = given or auth[7:].strip()
        return bool(given) and hmac.compare_digest(given.encode(), self.token.encode())

    def models_answer(self) -> tuple[int, dict[str, Any]]:
        """``GET /v1/models``, an operation of the session like any (rate, concurrency, count)."""
        try:
            self.session.models()
        except Exception as exc:  # noqa: BLE001 - answered in the caller's shape
            return self.error_for(None, failure_of(exc))
        return 200, self.models()

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                            "owned_by": "prorl-celery", "type": "model",
                                            "display_name": self.model}]}

    def error_for(self, dialect: Any, failure: Failure) -> tuple[int, dict[str, Any]]:
        if dialect is None:
            dialect = self.routes[("POST", "/v1/chat/completions")][0]
        return dialect.error(failure)

    def handle(self, handler: _Handler, dialect: Any, op: str, body: Any) -> None:
        try:
            self._answer(handler, dialect, op, body)
        finally:
            try:
                self.session.answered()
            except Exception:  # noqa: BLE001 - the call is answered; its lease lapses by itself
                log.exception("gateway %s: after the answer", self.session.session_id)

    def _answer(self, handler: _Handler, dialect: Any, op: str, body: Any) -> None:
        try:
            if isinstance(body, BadCall):
                raise body
            request = dialect.parse(body)
            if op == "count":
                handler._json(200, dialect.count(self.session.count_tokens(request)))
                return
            turn = self.session.complete(request, dialect.name)
        except Exception as exc:  # noqa: BLE001 - every failure is answered in the caller's shape
            failure = failure_of(exc)
            if failure.kind == "internal":
                log.exception("gateway %s: call failed", self.session.session_id)
            handler._json(*dialect.error(failure))
            return
        if request.stream:
            handler._events(dialect.stream(turn, request))
        else:
            handler._json(200, dialect.respond(turn, request))
