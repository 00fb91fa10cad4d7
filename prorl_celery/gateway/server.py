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
import socket
from typing import Any

from prorl_celery import jsonfast
from prorl_celery.gateway.apis import load_all
from prorl_celery.gateway.apis.base import BadCall, Failure, failure_of
from prorl_celery.gateway.framing import Headers, Refusal
from prorl_celery.gateway.serving import Exchange, Limits, Serving, response
from prorl_celery.gateway.session import GatewaySession
from prorl_celery.handshake import relay_key

log = logging.getLogger(__name__)


class Gateway:
    """Serves one :class:`GatewaySession`. ``token`` is the session's credential (Bearer or
    ``x-api-key``); ``model`` the name ``/v1/models`` lists. Start with :meth:`start`; the
    harness's base URL is :attr:`url` (TCP) or the socket path (:attr:`socket_path`). Its
    connections are served on the process's event loop within ``limits``
    (:mod:`prorl_celery.gateway.serving`)."""

    def __init__(self, session: GatewaySession, token: str, model: str = "prorl-gateway",
                 host: str = "127.0.0.1", port: int = 0, socket_path: str | None = None,
                 limits: Limits | None = None):
        self.session, self.token, self.model = session, token, model
        self.routes = load_all()
        self.socket_path = socket_path
        self.serving = Serving(self, session.session_id, limits)
        if socket_path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(socket_path)
            os.chmod(socket_path, 0o666)  # the sandbox's uid connects; the token is the lock
        else:
            sock = _tcp_socket(host, port)
        self.address = sock.getsockname()
        self.serving.listen(sock)
        self.relay_address: str | None = None
        self._started = self._closed = False

    def listen_tcp(self, host: str) -> str:
        """Also serve on TCP at ``host`` (a free port): the address a sandbox host on another node
        relays the session's socket to (:mod:`sandboxes.host.relay`). A connection there is read
        only once it answered the relay handshake with the session's relay key
        (:attr:`relay_key`, :mod:`prorl_celery.handshake`). Before :meth:`start`. Returns
        ``host:port``."""
        assert not self._started, "listen_tcp() after start()"
        sock = _tcp_socket(host, 0)
        bound, port = sock.getsockname()[:2]
        self.serving.listen(sock, relay_key=bytes.fromhex(self.relay_key))
        self.relay_address = f"[{bound}]:{port}" if ":" in bound else f"{bound}:{port}"
        return self.relay_address

    @property
    def relay_key(self) -> str:
        """The session's relay key (hex): what the worker gives the sandbox host with the relay."""
        return relay_key(self.token)

    @property
    def url(self) -> str:
        host, port = self.address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "Gateway":
        if not self._started:
            self._started = True
            self.serving.start()
        return self

    def close(self) -> None:
        """Abort in-flight calls, stop serving, remove the socket."""
        if self._closed:
            return
        self._closed = True
        self.session.cancel()
        self.serving.close()
        if self.socket_path and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def __enter__(self) -> "Gateway":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def authorize(self, method: str, path: str, headers: Headers) -> Refusal | None:
        """From the head alone, before any body is read: the session's credential, or a refusal."""
        if self.authorized(headers):
            return None
        return Refusal(401, "auth", "missing or wrong session credential")

    def refusal(self, refusal: Refusal) -> tuple[int, bytes]:
        """A refused request's whole answer (the connection closes after it)."""
        status, body = self.error_for(None, Failure(refusal.status, refusal.kind, refusal.message))
        return status, response(status, "application/json", jsonfast.dumps(body), keep_alive=False)

    def serve(self, exchange: Exchange) -> None:
        """One authorized request, on a call thread: routed, answered in its dialect's shape."""
        request = exchange.request
        path = request.path.rstrip("/")
        dialect, op = self.routes.get((request.method, path), (None, ""))
        if request.method == "GET" and path in ("/v1/models", "/models"):
            exchange.json(*self.models_answer())
            return
        if dialect is None:
            exchange.json(*self.error_for(None, Failure(404, "not_found", f"no route {request.method} {path}")))
            return
        try:
            body = jsonfast.loads(request.body) if request.body else None
        except ValueError:
            body = BadCall(Failure(400, "invalid_request", "the body is not JSON"))
        self.handle(exchange, dialect, op, body)

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

    def handle(self, handler: Exchange, dialect: Any, op: str, body: Any) -> None:
        try:
            self._answer(handler, dialect, op, body)
        finally:
            try:
                self.session.answered()
            except Exception:  # noqa: BLE001 - the call is answered; its lease lapses by itself
                log.exception("gateway %s: after the answer", self.session.session_id)

    def _answer(self, handler: Exchange, dialect: Any, op: str, body: Any) -> None:
        try:
            if isinstance(body, BadCall):
                raise body
            request = dialect.parse(body)
            if op == "count":
                handler.json(200, dialect.count(self.session.count_tokens(request)))
                return
            turn = self.session.complete(request, dialect.name)
        except Exception as exc:  # noqa: BLE001 - every failure is answered in the caller's shape
            failure = failure_of(exc)
            if failure.kind == "internal":
                log.exception("gateway %s: call failed", self.session.session_id)
            handler.json(*dialect.error(failure))
            return
        if request.stream:
            handler.events(dialect.stream(turn, request))
        else:
            handler.json(200, dialect.respond(turn, request))


def _tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock
