"""The sandbox host's HTTP API: a Flask app over a :class:`~sandboxes.host.pool.SandboxPool`.

Every route but ``GET /health`` needs ``Authorization: Bearer <token>``. Errors are
``{"error": {"type", "message", "field"?}}`` with the status of their class in
:mod:`prorl_celery.errors`; the client re-raises them by type. A create the operator's policy
refuses (a runtime not served, an unregistered image) is 403 ``policy_denied`` naming the field,
as on the API: the token does not carry the right to widen the policy.
"""
from __future__ import annotations

import hmac
from collections.abc import Callable, Iterator
from typing import Any

from flask import Flask, Response, request
from pydantic import BaseModel, ValidationError

from prorl_celery.errors import (ErrorBody, ErrorDetail, FileError, InvalidRequest, NotFound,
                                 ProrlError, SandboxGone)
from sandboxes.base import ExecResult
from sandboxes.host.pool import SandboxPool, limit_enforcement
from sandboxes.host.strays import list_strays, stop_strays
from sandboxes.protocol import (METHODS, CloseManyRequest, CloseManyResponse, CloseResponse, CreateRequest,
                                FinishResponse, Health,
                                LayerList, Method, RemoveLayersRequest, RemoveLayersResponse, SandboxList,
                                StopStraysRequest, StrayList)
from sandboxes.runtimes.workspace import stream_capped


def error(type_: str, message: str, status: int) -> Response:
    """An error the framework answers (no such route, no token): not one of the service's own."""
    return _json(ErrorBody(error=ErrorDetail(type=type_, message=message)), status)


def respond(exc: ProrlError) -> Response:
    return _json(ErrorBody(error=exc.to_dict()), exc.http_status)


def _json(body: ErrorBody, status: int) -> Response:
    return Response(body.model_dump_json(exclude_none=True), status, mimetype="application/json")


def ok(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status, mimetype="application/json")


def parse(model: type[BaseModel]) -> BaseModel:
    try:
        return model.model_validate_json(request.get_data() or b"{}")
    except ValidationError as exc:
        raise InvalidRequest(str(exc)) from exc


def _gone_with_predecessor(pool: SandboxPool, path: str) -> ProrlError | None:
    """A call about a sandbox this host does not have, with a token that is not this host's:
    most likely a handle from an earlier run of the host at this address (a restart makes a new
    token). Its sandbox is gone, which is what the caller must hear (it then runs the job again),
    not 401. Sandbox ids are 64 random bits: this tells a stranger nothing it could use."""
    parts = path.split("/")
    if len(parts) < 3 or parts[1] != "sandboxes" or not parts[2] or parts[2] in pool._slots:
        return None
    return SandboxGone(f"no sandbox {parts[2]!r} on this host (its host restarted?)")


def _refusal(pool: SandboxPool, expected: bytes, method: str, path: str,
             authorization: str) -> tuple[ErrorBody, int] | None:
    """Whether a request is refused from its head (method, path, Authorization) alone."""
    if path == "/health" and method == "GET":
        return None
    if hmac.compare_digest(authorization.encode(), expected):
        return None
    gone = _gone_with_predecessor(pool, path)
    if gone is not None:
        return ErrorBody(error=gone.to_dict()), gone.http_status
    return ErrorBody(error=ErrorDetail(type="unauthorized", message="missing or wrong bearer token")), 401


def head_check(pool: SandboxPool, token: str) -> Callable[[str, str, dict[str, str]], tuple[int, bytes] | None]:
    """The host's check of a request's head, for :func:`sandboxes.host.gate.gated_channel`: the
    same answer the app gives, decided before waitress reads the body."""
    expected = f"Bearer {token}".encode()

    def check(method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes] | None:
        refused = _refusal(pool, expected, method, path, headers.get("AUTHORIZATION", ""))
        if refused is None:
            return None
        body, status = refused
        return status, body.model_dump_json(exclude_none=True).encode()

    return check


def create_app(pool: SandboxPool, token: str, runtimes: list[str] | None = None) -> Flask:
    """``runtimes`` is ignored: the pool's served runtimes are the ones the host serves."""
    app = Flask("sandboxes.host.main")
    expected = f"Bearer {token}".encode()

    @app.before_request
    def authenticate() -> Response | None:
        # the gate (gate.py) refuses such a request from its head under waitress; this holds
        # for any other server of the app
        refused = _refusal(pool, expected, request.method, request.path,
                           request.headers.get("Authorization", ""))
        return None if refused is None else _json(*refused)

    @app.errorhandler(ProrlError)
    def prorl_error(exc: ProrlError) -> Response:
        return respond(exc)

    @app.errorhandler(OSError)  # what a runtime raises in process: FileNotFoundError ...
    def os_error(exc: OSError) -> Response:
        return respond(FileError.wrap(exc))

    @app.errorhandler(404)
    @app.errorhandler(405)
    def no_route(exc) -> Response:
        return error("not_found", f"{request.method} {request.path}: {exc.description}", exc.code)

    @app.get("/health")
    def health() -> Response:
        served = pool.served
        return ok(Health(host_id=pool.host_id, live=pool.live, capacity=pool.capacity,
                         runtimes=served.names, auto=served.auto, isolation=served.isolation(),
                         limit_enforcement=limit_enforcement()))

    @app.post("/sandboxes")
    def create() -> Response:
        body = parse(CreateRequest)
        return ok(pool.create(body.job_id, body.spec, body.lease_s, body.keeper), 201)

    @app.get("/sandboxes")
    def list_sandboxes() -> Response:
        return ok(SandboxList(sandboxes=pool.entries()))

    @app.post("/sandboxes/<sandbox_id>/<method>")
    def call(sandbox_id: str, method: str) -> Response:  # one route for every protocol method
        return _answer(method, _call(pool, sandbox_id, method, _request_of(method)))

    @app.get("/sandboxes/<sandbox_id>/files")  # the read and write paths callers already use
    def read_file(sandbox_id: str) -> Response:
        return call(sandbox_id, "read_file")

    @app.put("/sandboxes/<sandbox_id>/files")
    def write_file(sandbox_id: str) -> Response:
        return call(sandbox_id, "write_file")

    @app.delete("/sandboxes/<sandbox_id>")
    def close(sandbox_id: str) -> Response:
        return call(sandbox_id, "close")

    @app.post("/sandboxes/close")
    def close_many() -> Response:  # a bulk cancel: one call instead of one per sandbox
        ids = parse(CloseManyRequest).sandbox_ids
        return ok(CloseManyResponse(closed=pool.close_many(ids, "closed in bulk")))

    @app.get("/strays")
    def strays() -> Response:  # the beat sweep's question: what runs here outside any host
        return ok(StrayList(strays=list_strays(pool)))

    @app.post("/strays/stop")
    def strays_stop() -> Response:
        return ok(stop_strays(pool, parse(StopStraysRequest).strays))

    @app.get("/layers")
    def layers() -> Response:  # the beat sweep's question: which frozen layers this node keeps
        from sandboxes.runtimes import layers as node_layers

        node_layers.remove_debris()
        return ok(LayerList(layers=node_layers.list_layers()))

    @app.post("/layers/remove")
    def layers_remove() -> Response:  # the sweep's word: never one a live sandbox holds
        from sandboxes.runtimes import layers as node_layers

        return ok(RemoveLayersResponse(removed=node_layers.remove(parse(RemoveLayersRequest).layers)))

    from sandboxes.host.hot import hot_routes  # create, exec, close: the same answers, without Flask

    app.wsgi_app = hot_routes(app, pool, expected)  # type: ignore[method-assign]
    return app


def _method(name: str) -> Method:
    method = METHODS.get(name)
    if method is None:
        raise NotFound(f"no protocol method {name!r}; the methods: {', '.join(METHODS)}")
    return method


def _request_of(name: str) -> BaseModel:
    """The method's request model: from the JSON body, or from the query string and, for one
    that carries ``data``, the raw body."""
    method = _method(name)
    if not method.raw_request and not request.args:
        return parse(method.request)
    fields: dict[str, Any] = request.args.to_dict()
    if method.raw_request:
        fields["data"] = request.get_data()
    try:
        return method.request.model_validate(fields)
    except ValidationError as exc:
        raise InvalidRequest(str(exc)) from exc


def _call(pool: SandboxPool, sandbox_id: str, name: str, body: BaseModel) -> BaseModel | Iterator[bytes]:
    """Run one protocol method on the pool's sandbox; what it returns, as its response model
    (a file read: the file's chunks, streamed)."""
    args = dict(body)
    if name in _POOL_CALLS:
        return _method(name).respond(_POOL_CALLS[name](pool, sandbox_id, args))
    with pool.using(sandbox_id) as sandbox:
        opened = sandbox.open_file(args["path"]) if name == "read_file" else None  # a declared hook
        if opened is not None:  # size-checked, then streamed
            return stream_capped(opened)
        return _method(name).respond(getattr(sandbox, name)(**args))


def _exec(pool: SandboxPool, sandbox_id: str, args: dict[str, Any]) -> ExecResult:
    return exec_from(pool, sandbox_id, args, request.environ)


def exec_from(pool: SandboxPool, sandbox_id: str, args: dict[str, Any], environ: dict[str, Any]) -> ExecResult:
    """An exec for the request whose WSGI ``environ`` this is (the app's route and the hot path's):
    waitress tells (channel_request_lookahead > 0) when the caller hung up, e.g. its worker was
    killed, and then the command is interrupted and the sandbox's lease runs again."""
    return pool.exec(sandbox_id, args["command"], args["timeout"], environ.get("waitress.client_disconnected"))


def _info(pool: SandboxPool, sandbox_id: str, args: dict[str, Any]) -> dict[str, Any]:
    for entry in pool.entries():
        if entry.sandbox_id == sandbox_id:
            usage = pool.usage(sandbox_id)  # read now: a few small cgroup files
            return {**entry.info, "host_id": entry.host_id, "expires_at": entry.expires_at,
                    "usage": usage.model_dump() if usage else None}
    raise SandboxGone(f"no sandbox {sandbox_id!r} on host {pool.host_id}")


def _close(pool: SandboxPool, sandbox_id: str, args: dict[str, Any]) -> CloseResponse:
    closed, usage = pool.close_measured(sandbox_id)
    return CloseResponse(closed=closed, usage=usage)


def _finish(pool: SandboxPool, sandbox_id: str, args: dict[str, Any], name: str = "finish") -> Any:
    """The sandbox's finish (killed, read, closed) or freeze (killed, frozen, closed), then its
    slot closed too, and a finish's answer says what it (and its sidecars) used; a path refused
    before anything was killed leaves it running."""
    reason = f"{name}ed" if name == "finish" else "frozen"
    try:
        with pool.using(sandbox_id) as sandbox:
            out = getattr(sandbox, name)(**args)
    except PermissionError:
        raise
    except BaseException:
        pool.close(sandbox_id, reason)
        raise
    _, usage = pool.close_measured(sandbox_id, reason)  # the runtime's reading taken at its close
    return out.model_copy(update={"usage": usage}) if isinstance(out, FinishResponse) else out


# methods the pool answers itself (its lease, its watch on the caller, its entry)
_POOL_CALLS: dict[str, Callable[[SandboxPool, str, dict[str, Any]], Any]] = {
    "exec": _exec, "info": _info, "finish": _finish,
    "freeze": lambda pool, sandbox_id, args: _finish(pool, sandbox_id, args, "freeze"),
    "close": _close,
    "renew": lambda pool, sandbox_id, args: pool.renew(sandbox_id, args["lease_s"]),
    "relay": lambda pool, sandbox_id, args: pool.relay(sandbox_id, **args),
    "forward": lambda pool, sandbox_id, args: pool.forward(sandbox_id, **args),
}


def _answer(name: str, response: BaseModel | Iterator[bytes]) -> Response:
    if isinstance(response, BaseModel) and not _method(name).raw_response:
        return ok(response)
    data = response.data if isinstance(response, BaseModel) else response  # type: ignore[attr-defined]
    return Response(data, 200, mimetype="application/octet-stream")
