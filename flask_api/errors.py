"""Errors as JSON: ``{"error": {"type", "message", "field"?}}`` with a stable ``type``."""
from __future__ import annotations

import hmac
import logging
from typing import Any

import redis
from flask import Flask, Response, current_app, g, jsonify, request
from pydantic import BaseModel, ValidationError
from werkzeug.exceptions import HTTPException

from prorl_celery.errors import InvalidRequest, ProrlError, StoreUnavailable, error_body
from prorl_celery.projects import ProjectStore

log = logging.getLogger(__name__)
_OPEN_PATHS = ("/healthz",)  # probes: they say only whether the service is up
# What a refused caller needs to know to succeed; NeMo Gym's prorl_agent sends no header at all.
NO_TOKEN = ("no 'Authorization: Bearer <token>' header: every route but /healthz needs the API's token "
            "(the operator's PRORL_API_TOKEN; `prorl-celery up` writes it to secrets.env in its state "
            "directory). NeMo Gym's prorl_agent sends none: call "
            "prorl_celery.integrations.nemo_gym.patch_prorl_agent() in its agent server's process first "
            "(README, 'NeMo RL')")
WRONG_TOKEN = ("the bearer token is neither the API's (PRORL_API_TOKEN) nor a live project key (`prorl-celery "
               "projects add`; a revoked one is refused): send 'Authorization: Bearer <token>' with one")


def error_response(status: int, type_: str, message: str, **extra: Any) -> tuple[Response, int]:
    """An answer in the shape of every error, for what is not a :class:`ProrlError` of its own
    (a missing token, a framework error)."""
    return jsonify(error_body(type_, message, **extra)), status


MAX_JSON_DEPTH = 100  # far beyond any instance; far below where parsing or validating recurses too deep


def json_body() -> Any:
    """The request's JSON body, None when it is not JSON. One nested deeper than
    :data:`MAX_JSON_DEPTH` is refused naming the body (the parser itself recurses: ~990 levels
    raised ``RecursionError``, a 500)."""
    try:
        data = request.get_json(silent=True)
    except RecursionError:
        data = None
    else:
        if not _too_deep(data, MAX_JSON_DEPTH):
            return data
    raise InvalidRequest(f"body: the JSON document nests deeper than {MAX_JSON_DEPTH} levels", field="body")


def _too_deep(data: Any, limit: int) -> bool:
    """Whether ``data`` nests objects and arrays more than ``limit`` deep (without recursing)."""
    pending = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        pending.extend((child, depth + 1) for child in children)
    return False


def parse_body(model: type[BaseModel]) -> BaseModel:
    """The request's JSON body validated against ``model``; InvalidRequest names the field."""
    data = json_body()
    if data is None:
        raise InvalidRequest("the body must be a JSON document (Content-Type: application/json)")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [*first["loc"], *([first["ctx"]["loc"]] if "loc" in first.get("ctx", {}) else [])]
        field = ".".join(str(part) for part in loc) or None
        raise InvalidRequest(f"{field or 'body'}: {first['msg']}", field=field) from None


def _handle_prorl(exc: ProrlError):
    """The class's own status, as on the sandbox host: one type, one status on every server
    (a request the operator's policy refuses is 403 ``policy_denied`` here too). One that says
    when to come back (a project over a quota) says it in ``Retry-After`` too."""
    body = jsonify({"error": exc.to_dict()})
    if getattr(exc, "retry_after", None):
        body.headers["Retry-After"] = str(exc.retry_after)
    return body, exc.http_status


def _handle_http(exc: HTTPException):
    return error_response(exc.code or 500, exc.name.lower().replace(" ", "_"), exc.description or "")


def _handle_store(exc: redis.RedisError):
    """A Redis outage is the service's, not the request's: 503, never a 500 ``internal``
    (seen under the chaos run: BusyLoadingError while a restarted Redis loads its AOF)."""
    log.warning("%s %s: job store unavailable: %s", request.method, request.path, exc)
    body, status = _handle_prorl(StoreUnavailable(f"the job store is unavailable ({type(exc).__name__}); retry"))
    body.headers["Retry-After"] = "1"
    return body, status


def _handle_other(exc: Exception):
    log.exception("unhandled error in %s %s", request.method, request.path)
    return error_response(500, "internal", f"{type(exc).__name__}: {exc}")


def _bearer(header: str) -> bytes | None:
    """The credential of ``Authorization: Bearer <credential>`` as bytes; None if malformed.
    Bytes, because ``compare_digest`` raises on a str with non-ASCII characters."""
    scheme, _, credential = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        return None
    return credential.strip().encode("utf-8", "surrogateescape")


def _check_token():
    """Every route but the probes needs the operator's token or a live project key
    (``g.project``: None for the operator, else the key's project); an app without a token
    configured refuses all (fails closed, never open)."""
    if request.path in _OPEN_PATHS:
        return None
    token = current_app.config.get("API_TOKEN")
    given = _bearer(request.headers.get("Authorization", ""))
    if given is None:
        return error_response(401, "unauthorized", NO_TOKEN)
    if not token:
        return error_response(401, "unauthorized", WRONG_TOKEN)
    if hmac.compare_digest(given, token.encode("utf-8")):
        g.project, g.authenticated = None, True
        return None
    g.project = ProjectStore(current_app.extensions["prorl_store"].redis).authenticate(given)
    if g.project is None:
        return error_response(401, "unauthorized", WRONG_TOKEN)
    g.authenticated = True
    return None


def init_app(app: Flask) -> None:
    app.register_error_handler(ProrlError, _handle_prorl)
    app.register_error_handler(HTTPException, _handle_http)
    app.register_error_handler(redis.RedisError, _handle_store)
    app.register_error_handler(Exception, _handle_other)
    app.before_request(_check_token)
