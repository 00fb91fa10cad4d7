"""Completions in completion order: a long poll (``/completions``) and server-sent events (``/events``).

Both resume from a cursor (the ``cursor`` parameter, or SSE's ``Last-Event-ID``), so a trainer
that reconnects misses nothing and sees nothing twice.
"""
from __future__ import annotations

import json

from flask import Blueprint, Response, current_app, jsonify, request, stream_with_context

from flask_api import schemas as s
from flask_api.limits import acquire_stream
from flask_api.routes import WAIT_SECONDS, route
from flask_api.tenancy import caller
from prorl_celery import completions
from prorl_celery.errors import InvalidRequest

bp = Blueprint("stream", __name__)
KEEPALIVE_S = 15.0
LINGER_MAX_S = 5.0
# After the first completion, how much longer a long poll gathers more (within its wait).
LINGER_SECONDS = {"type": "number", "minimum": 0, "maximum": LINGER_MAX_S}


def _cursor(raw: str | None) -> str | None:
    if raw and not completions.valid_cursor(raw):
        raise InvalidRequest("cursor must be a cursor returned by this API (e.g. '0-0')", field="cursor")
    return raw or None


def _number(name: str, default: float, low: float, high: float) -> float:
    try:
        value = float(request.args.get(name, default))
    except ValueError:
        raise InvalidRequest(f"{name} must be a number", field=name) from None
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be within {low}..{high}", field=name)
    return value


@route(bp, "get", "/completions", "Finished jobs after a cursor, in completion order (long poll)",
       {200: s.CompletionsResponse, 400: s.ErrorBody},
       query={"cursor": {"type": "string"}, "wait": WAIT_SECONDS, "limit": {"type": "integer", "minimum": 1,
                                                                     "maximum": 5000},
              "group_id": {"type": "string"}, "linger": LINGER_SECONDS}, tag="stream")
def get_completions():
    cursor = _cursor(request.args.get("cursor"))
    wait = _number("wait", 0, 0, current_app.config["WAIT_MAX_S"])
    limit = int(_number("limit", 500, 1, 5000))
    linger = _number("linger", 0, 0, LINGER_MAX_S)
    release = acquire_stream() if wait > 0 else (lambda: None)  # a long poll holds a thread
    try:
        items, next_cursor = completions.read(current_app.extensions["prorl_store"], cursor, wait,
                                              request.args.get("group_id") or None, limit, project=caller(),
                                              linger_s=linger)
    finally:
        release()
    return jsonify({"cursor": next_cursor, "completions": items})


@route(bp, "get", "/events", "Finished jobs as server-sent events; resumes from Last-Event-ID",
       {200: None, 400: s.ErrorBody}, query={"cursor": {"type": "string"}, "group_id": {"type": "string"}},
       tag="stream")
def events():
    cursor = _cursor(request.headers.get("Last-Event-ID") or request.args.get("cursor"))
    group_id = request.args.get("group_id") or None
    store, project = current_app.extensions["prorl_store"], caller()
    release = acquire_stream()  # held until the server closes the response (client gone)

    def generate():
        position = cursor
        yield "retry: 1000\n\n"
        while True:
            items, position = completions.read(store, position, KEEPALIVE_S, group_id, project=project)
            if not items:
                yield ": keepalive\n\n"
            for item in items:
                yield f"id: {item['cursor']}\nevent: completion\ndata: {json.dumps(item)}\n\n"

    response = Response(stream_with_context(generate()), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.call_on_close(release)
    return response
