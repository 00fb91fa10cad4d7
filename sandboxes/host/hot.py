"""The sandbox host's hot routes answered without Flask's request machinery: a WSGI middleware
in front of the app (``app.wsgi_app``).

A rollout with a sandbox makes three calls to its host: ``POST /sandboxes`` (create),
``POST /sandboxes/<id>/exec`` and ``POST /sandboxes/<id>/close``. Flask's request context, URL
map, before-request hook, error-handler lookup and response object cost ~0.1 ms of the host's
CPU per call (bench/RESULTS.md, "The sandbox's cycle"). These three are answered here from the
WSGI environ, by the same functions the app's routes call (:mod:`sandboxes.host.app`): the same
token check (``_refusal``), the same bodies and statuses, errors mapped as the app's handlers map
them (:class:`~prorl_celery.errors.ProrlError` by its class, ``OSError`` as ``FileError``, any
other exception as Flask's 500 after logging it as Flask does). Everything else, and these
routes with a query string, goes to the app unchanged.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, ValidationError
from werkzeug.exceptions import InternalServerError
from werkzeug.http import HTTP_STATUS_CODES

from prorl_celery.errors import ErrorBody, FileError, InvalidRequest, ProrlError
from sandboxes.protocol import CreateRequest

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
_JSON = "application/json"
HOT_CALLS = frozenset({"exec", "close"})  # POST /sandboxes/<id>/<name> answered here


def hot_routes(flask_app: Any, pool: Any, expected: bytes) -> WSGIApp:
    """``flask_app.wsgi_app`` with create, exec and close answered in front of it."""
    from sandboxes.host import app as host_app

    fallback: WSGIApp = flask_app.wsgi_app

    def create(environ: dict[str, Any], sandbox_id: str, name: str) -> tuple[BaseModel, int]:
        body = _parse(environ, CreateRequest)
        return pool.create(body.job_id, body.spec, body.lease_s, body.keeper), 201

    def call(environ: dict[str, Any], sandbox_id: str, name: str) -> tuple[BaseModel, int]:
        method = host_app.METHODS[name]
        args = dict(_parse(environ, method.request))
        if name == "exec":  # from the environ, which the app's own route reads through Flask's request
            return method.respond(host_app.exec_from(pool, sandbox_id, args, environ)), 200
        return method.respond(host_app._POOL_CALLS[name](pool, sandbox_id, args)), 200

    def middleware(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        handler, sandbox_id, name = _route(environ.get("REQUEST_METHOD", ""), path, create, call)
        if handler is None or environ.get("QUERY_STRING"):
            return fallback(environ, start_response)
        refused = host_app._refusal(pool, expected, "POST", path, environ.get("HTTP_AUTHORIZATION", ""))
        if refused is not None:
            body, status = refused
            return _send(start_response, status, body.model_dump_json(exclude_none=True).encode())
        try:
            model, status = handler(environ, sandbox_id, name)
            return _send(start_response, status, model.model_dump_json().encode())
        except ProrlError as exc:
            return _error(start_response, exc)
        except OSError as exc:  # what a runtime raises in process (FileNotFoundError ...)
            return _error(start_response, FileError.wrap(exc))
        except Exception as exc:  # noqa: BLE001 - Flask's answer to an unhandled exception
            flask_app.logger.error(f"Exception on {path} [POST]", exc_info=sys.exc_info())
            return InternalServerError(original_exception=exc)(environ, start_response)

    middleware.fallback = fallback  # type: ignore[attr-defined]  # the app's own answer (tests compare)
    return middleware


def _route(method: str, path: str, create: Any, call: Any) -> tuple[Any, str, str]:
    """(handler, sandbox id, method name) of a hot route; (None, "", "") for any other."""
    if method != "POST":
        return None, "", ""
    if path == "/sandboxes":
        return create, "", ""
    parts = path.split("/")
    if len(parts) == 4 and parts[1] == "sandboxes" and parts[2] and parts[3] in HOT_CALLS:
        return call, parts[2], parts[3]
    return None, "", ""


def _parse(environ: dict[str, Any], model: type[BaseModel]) -> Any:
    """As :func:`sandboxes.host.app.parse`: the body as ``model``, an empty one as ``{}``."""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    data = environ["wsgi.input"].read(length) if length > 0 else b""
    try:
        return model.model_validate_json(data or b"{}")
    except ValidationError as exc:
        raise InvalidRequest(str(exc)) from exc


def _error(start_response: Callable[..., Any], exc: ProrlError) -> list[bytes]:
    body = ErrorBody(error=exc.to_dict()).model_dump_json(exclude_none=True).encode()
    return _send(start_response, exc.http_status, body)


def _send(start_response: Callable[..., Any], status: int, body: bytes) -> list[bytes]:
    start_response(_status_line(status), [("Content-Type", _JSON), ("Content-Length", str(len(body)))])
    return [body]


@functools.lru_cache(maxsize=64)
def _status_line(status: int) -> str:
    """As werkzeug words it: "201 CREATED"."""
    return f"{status} {HTTP_STATUS_CODES.get(status, 'unknown').upper()}"
