"""The fake LLM server's routes as a Flask app (test and demo tool; see
:mod:`prorl_celery.fakes.llm.server`, which serves it on waitress).

Each route hands the request's JSON body to the endpoint of the dialect it names
(:mod:`~prorl_celery.fakes.llm.endpoints`, :mod:`~prorl_celery.fakes.llm.token_api`,
:mod:`~prorl_celery.fakes.llm.pause_api`) and answers with what it returns: a JSON body, server-sent
events, or nothing when the client went away. An endpoint's :class:`~prorl_celery.fakes.llm.wire.HTTPError`
is its server's error body; a path or method the fake does not serve is a 404 in vLLM's shape.

Two things a route needs from the server beyond WSGI (:mod:`~prorl_celery.fakes.llm.server` puts
them in the environ; under another server, e.g. Flask's test client, they are absent and the
fake simply does not watch for disconnects): ``prorl.fake.socket``, the client's connection (the
engine watches it to abort a sequence whose client hung up, as vLLM does; a fault drops it), and
``prorl.fake.close``, called to close the connection after the answer (a dead engine's server).
"""
from __future__ import annotations

import socket
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from flask import Flask, Response, request
from werkzeug.exceptions import MethodNotAllowed, NotFound

from prorl_celery import jsonfast
from prorl_celery.fakes.llm import pause_api
from prorl_celery.fakes.llm.endpoints import chat_completion, detokenize, models, tokenize
from prorl_celery.fakes.llm.state import BANNER, FakeLLM
from prorl_celery.fakes.llm.token_api import ROUTES, EventStream
from prorl_celery.fakes.llm.wire import HTTPError

SOCKET, CLOSE = "prorl.fake.socket", "prorl.fake.close"
Endpoint = Callable[[FakeLLM, dict[str, Any], Any], Any]
GENERATION: dict[str, Endpoint] = {"/v1/chat/completions": chat_completion, "/chat/completions": chat_completion,
                                   **ROUTES}
TOKENS: dict[str, Endpoint] = {"/tokenize": tokenize, "/detokenize": detokenize}  # no injected failures here
# status lines as the real servers (and http.server) write them, "404 Not Found", not werkzeug's "404 NOT FOUND"
STATUS = {s.value: f"{s.value} {s.phrase}" for s in HTTPStatus}


def create_app(fake: FakeLLM) -> Flask:
    """The fake's routes over ``fake``'s state."""
    app = Flask(__name__)
    _add_get_routes(app, fake)
    _add_post_routes(app, fake)
    app.register_error_handler(HTTPError, lambda exc: _error(fake, exc.status, str(exc), exc.type, exc.body))
    for missing in (NotFound, MethodNotAllowed):  # both "no route", as the fake always answered
        app.register_error_handler(missing, lambda exc: _error(fake, 404, f"no route {request.path}", "NotFoundError"))
    return app


def _answer(fake: FakeLLM, status: int, body: Any) -> Response:
    if fake.dead:  # the dying API server's open connections go with it
        close = request.environ.get(CLOSE)
        if close is not None:
            close()
    return Response(jsonfast.dumps(body), STATUS.get(status, status), content_type="application/json")


def _error(fake: FakeLLM, status: int, message: str, type_: str = "BadRequestError",
           body: dict[str, Any] | None = None) -> Response:
    return _answer(fake, status, body or {"error": {"message": message, "type": type_, "param": None, "code": status}})


def _add_get_routes(app: Flask, fake: FakeLLM) -> None:
    @app.get("/health")
    def health() -> Response:
        _check_healthy(fake)
        return _answer(fake, 503, {}) if fake.dead else _answer(fake, 200, {"status": "ok", "note": BANNER})

    @app.get("/v1/models", endpoint="models")
    @app.get("/models", endpoint="models_bare")
    def model_list() -> Response:
        _check_healthy(fake)
        return _answer(fake, 200, models(fake))

    @app.get("/get_load", endpoint="get_load")
    @app.get("/v1/loads", endpoint="loads")
    def load() -> Response:  # SGLang's load report, which sglang-router polls
        return _answer(fake, 200, [fake.engine.load()])

    @app.get("/debug/requests")
    def debug_requests() -> Response:
        since = int(request.args.get("since", "0"))
        with fake.lock:
            rows = [dict(r) for r in fake.records if r["id"] > since]
        return _answer(fake, 200, {"requests": rows})

    @app.get("/debug/stats")
    def debug_stats() -> Response:
        with fake.lock:
            extra = {"requests": len(fake.records), "errors": fake.errors, "faults": dict(fake.faults),
                     "pauses": list(fake.pauses)}
        return _answer(fake, 200, {**fake.engine.stats(), **extra})

    for path in pause_api.GET_ROUTES:
        app.add_url_rule(path, f"get{path}", lambda: _answer(fake, 200, pause_api.handle_get(fake, request.path)),
                         methods=["GET"])


def _check_healthy(fake: FakeLLM) -> None:
    if not fake.faults["healthy"]:
        raise HTTPError(503, "unhealthy (injected fault)", "ServiceUnavailable")


def _body() -> dict[str, Any]:
    """The request's JSON object (an empty body is ``{}``). Read from WSGI's input by its length:
    werkzeug's cached ``get_data`` costs a fifth of Flask's own time per request, and a body is
    read once (waitress ends the input at the body's end, chunked or not)."""
    length = request.content_length
    stream = request.environ["wsgi.input"]
    try:
        body = jsonfast.loads((stream.read(length) if length is not None else stream.read()) or b"{}")
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
    except ValueError as exc:
        raise HTTPError(400, f"invalid JSON body: {exc}") from None
    return body


def _add_post_routes(app: Flask, fake: FakeLLM) -> None:
    @app.post("/debug/reset")
    def debug_reset() -> Response:
        fake.reset()
        return _answer(fake, 200, {"reset": True})

    @app.post("/debug/faults")
    def debug_faults() -> Response:
        body = _body()
        with fake.lock:
            fake.faults.update({k: v for k, v in body.items() if k in fake.faults})
            faults = dict(fake.faults)
        return _answer(fake, 200, faults)

    for path in pause_api.POST_ROUTES:
        app.add_url_rule(path, f"post{path}", methods=["POST"], view_func=lambda: _answer(
            fake, 200, pause_api.handle_post(fake, request.path, request.args.to_dict(flat=False), _body())))
    for path in TOKENS:
        app.add_url_rule(path, f"post{path}", methods=["POST"],
                         view_func=lambda: _endpoint(fake, TOKENS[request.path], _body()))
    for path in GENERATION:
        app.add_url_rule(path, f"post{path}", methods=["POST"], view_func=lambda: _generation(fake))


def _generation(fake: FakeLLM) -> Response:
    body = _body()
    status = fake.injected_failure()
    if status == 0:  # drop the connection, no answer
        _drop(request.environ.get(SOCKET))
        return Response(b"", 500)
    if status is not None:
        raise HTTPError(status, "injected failure", "InternalServerError")
    return _endpoint(fake, GENERATION[request.path], body)


def _endpoint(fake: FakeLLM, endpoint: Endpoint, body: dict[str, Any]) -> Response:
    answer = endpoint(fake, body, request.environ.get(SOCKET))
    if answer is None:  # the client went away: nobody reads this
        return Response(b"", 499)
    if isinstance(answer, EventStream):  # every event at once, with a length, as the fake always sent them
        data = b"".join(b"data: " + jsonfast.dumps(event) + b"\n\n" for event in answer)
        return Response(data, STATUS[200], content_type="text/event-stream")
    return _answer(fake, 200, answer)


def _drop(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
