"""The HTTP face of :class:`prorl_celery.integrations.serve.LiveModelServer`: a Flask app
(:func:`create_app`) served by waitress in a thread of the trainer's process (:class:`ThreadedServer`),
as the API and the sandbox host are served.

Every route but ``GET /health`` needs the server's bearer token, checked before the body is
parsed (waitress has read it by then, up to ``max_body_bytes``; a larger one is a 413). Errors
answer in the shape of every error of the service, ``{"error": {"type", "message", "field"?}}``:
a body the server cannot honour, or a row that failed for its own values, is a 400 naming the
field (the LLM pool neither retries nor quarantines for a 4xx), a wrong pause mode or version name
a 422, a missing or wrong token a 401; the model's own failure is a 500 (the pool quarantines),
and ``/health`` is a 503 once the engine's thread is gone.
"""
from __future__ import annotations

import secrets
import threading
from typing import TYPE_CHECKING, Any

from flask import Blueprint, Flask, Response, current_app, jsonify, request
from pydantic import BaseModel, ValidationError
from waitress import create_server
from waitress.wasyncore import close_all
from werkzeug.exceptions import HTTPException

from prorl_celery.errors import ProrlError, error_body
from prorl_celery.integrations.live_schemas import CompletionRequest, GenerateRequest

if TYPE_CHECKING:
    from prorl_celery.integrations.serve import LiveModelServer

PAUSE_MODES = ("abort", "wait", "keep")
_OPEN_PATHS = ("/health",)


class _Refused(Exception):
    """An answer other than 200, raised from a view (turned into the error body by the app)."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.field = status, field


def _error(status: int, message: str, field: str | None = None) -> tuple[Response, int]:
    return jsonify(error_body("invalid_request" if status < 500 else "server_error", message, field)), status


def _parse(model: type[BaseModel], vocab: int | None) -> Any:
    """The request body as ``model`` (token ids checked against ``vocab``); a 400 naming the first
    field it refuses."""
    try:
        return model.model_validate_json(request.get_data() or b"{}", context={"vocab": vocab})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise _Refused(400, f"{field}: {first['msg']}" if field else first["msg"], field) from None


control = Blueprint("control", __name__)  # health, the model list and vLLM's pause API
sampling = Blueprint("sampling", __name__)  # the two token routes


def create_app(server: LiveModelServer) -> Flask:
    """The live server's routes over ``server`` (its engine, tokenizer and key)."""
    app = Flask("prorl-live-model")
    app.extensions["live_server"] = server
    expected = f"Bearer {server.api_key}".encode()

    @app.before_request
    def _authorised() -> Any:
        if request.path in _OPEN_PATHS or not server.api_key:
            return None
        # bytes: compare_digest refuses a str with non-ASCII characters (a header arrives as latin-1)
        given = request.headers.get("Authorization", "").encode("latin-1", "replace")
        if secrets.compare_digest(given, expected):
            return None
        return _error(401, "missing or wrong bearer token")

    @app.errorhandler(_Refused)
    def _refused(exc: _Refused) -> tuple[Response, int]:
        return _error(exc.status, str(exc), exc.field)

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> tuple[Response, int]:
        status = exc.code or 500
        return _error(status, f"no route {request.path}" if status == 404 else exc.description or exc.name)

    app.register_blueprint(control)
    app.register_blueprint(sampling)
    return app


def _server() -> LiveModelServer:
    return current_app.extensions["live_server"]


@control.get("/health")
def health() -> Any:
    if not _server().engine.alive:  # the pool's probe: a backend whose engine is gone stays out
        raise _Refused(503, "the sampling engine is not running")
    return {"status": "ok"}


@control.get("/v1/models")
def models() -> Any:
    server = _server()
    return {"object": "list", "data": [{"id": server.name, "object": "model", "max_model_len": server.max_model_len}]}


@control.get("/is_paused")
def is_paused() -> Any:
    return {"is_paused": _server().engine.paused}


@control.get("/weight_info")
def weight_info() -> Any:
    return {"weight_version": _server().engine.version}


@control.post("/pause")
def pause() -> Any:
    mode = request.args.get("mode") or "abort"
    if mode not in PAUSE_MODES:
        raise _Refused(422, f"mode: one of {', '.join(PAUSE_MODES)} (got {mode!r})", "mode")
    _server().pause(mode)
    return {"status": "paused"}


@control.post("/resume")
def resume() -> Any:
    _server().resume()
    return {"status": "resumed"}


@control.post("/update_weight_version")
def update_weight_version() -> Any:
    body = request.get_json(silent=True, force=True)
    version = body.get("new_version") if isinstance(body, dict) else None
    if not isinstance(version, str) or not version:
        raise _Refused(422, "new_version: a non-empty string is required", "new_version")
    _server().engine.name_version(version)
    return {"success": True, "new_version": version}


@sampling.post("/v1/completions")
def completions() -> Any:
    server = _server()
    return _answer(server.completion, _parse(CompletionRequest, server.vocab))


@sampling.post("/inference/v1/generate")
def generate() -> Any:
    server = _server()
    return _answer(server.generate, _parse(GenerateRequest, server.vocab))


def _answer(answer: Any, req: BaseModel) -> Any:
    """``answer(req)``; a row refused for its own fault is a 4xx naming the field (the pool then
    neither retries nor quarantines), any other failure a 500 (the backend's fault)."""
    # waitress tells (channel_request_lookahead) when the caller hung up: its row then ends
    gone = request.environ.get("waitress.client_disconnected")
    try:
        return answer(req, gone)
    except ProrlError as exc:
        return jsonify({"error": exc.to_dict()}), exc.http_status
    except ValueError as exc:
        raise _Refused(400, str(exc), "prompt") from None
    except Exception as exc:  # noqa: BLE001 - the service sees a 500 and retries elsewhere
        raise _Refused(500, f"{type(exc).__name__}: {exc}") from None


class ThreadedServer:
    """A WSGI app served by waitress on ``host:port`` (0: a free one) from a daemon thread.
    ``threads`` bounds the requests served at once (a sampling request holds its thread until its
    row is done)."""

    def __init__(self, app: Flask, host: str, port: int, threads: int, max_body_bytes: int):
        self._server = create_server(app, host=host, port=port, threads=threads, ident="prorl-live-model",
                                     connection_limit=max(100, 2 * threads), channel_timeout=600,
                                     max_request_body_size=max_body_bytes, asyncore_use_poll=True,
                                     channel_request_lookahead=1)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return str(self._server.effective_host), int(self._server.effective_port)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.run, name="live-model-server", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listening socket and every connection (inside the loop's own thread, which
        then ends), and the worker threads."""
        if self._thread is not None and self._thread.is_alive():
            self._server.trigger.pull_trigger(lambda: close_all(self._server._map))
            self._thread.join(timeout)
        else:
            self._server.close()
        self._server.task_dispatcher.shutdown(timeout=timeout)
