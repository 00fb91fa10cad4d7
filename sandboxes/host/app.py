"""The sandbox host's HTTP API: a Flask app over a :class:`~sandboxes.host.pool.SandboxPool`.

Every route but ``GET /health`` needs ``Authorization: Bearer <token>``. Errors are
``{"error": {"type", "message", "field"?}}`` with the status of their class in
:mod:`prorl_celery.errors`; the client re-raises them by type. A create the operator's policy
refuses (a runtime not served, an unregistered image) is 403 ``policy_denied`` naming the field:
the token does not carry the right to widen the policy.
"""
from __future__ import annotations

import hmac
import tempfile
from collections.abc import Iterator
from typing import IO

from flask import Flask, Response, request
from pydantic import BaseModel, ValidationError

from prorl_celery.errors import ErrorBody, ErrorDetail, FileError, InvalidRequest, ProrlError, SandboxGone
from sandboxes.runtimes.workspace import stream_capped
from sandboxes.host.pool import SandboxPool, limit_enforcement
from sandboxes.protocol import (CloseManyRequest, CloseManyResponse, CloseResponse, CreateRequest,
                                ExecRequest, Health, RenewRequest, SandboxList)


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


def file_path() -> str:
    path = request.args.get("path")
    if not path:
        raise InvalidRequest("query parameter 'path' is required", field="path")
    return path


def _gone_with_predecessor(pool: SandboxPool) -> Response | None:
    """A call about a sandbox this host does not have, with a token that is not this host's:
    most likely a handle from an earlier run of the host at this address (a restart makes a new
    token). Its sandbox is gone, which is what the caller must hear (it then runs the job again),
    not 401. Sandbox ids are 64 random bits: this tells a stranger nothing it could use."""
    parts = request.path.split("/")
    if len(parts) < 3 or parts[1] != "sandboxes" or not parts[2] or parts[2] in pool._slots:
        return None
    return respond(SandboxGone(f"no sandbox {parts[2]!r} on this host (its host restarted?)"))


def create_app(pool: SandboxPool, token: str, runtimes: list[str] | None = None) -> Flask:
    """``runtimes`` is ignored: the pool's served runtimes are the ones the host serves."""
    app = Flask("sandboxes.host.main")
    expected = f"Bearer {token}".encode()

    @app.before_request
    def authenticate() -> Response | None:
        if request.path == "/health" and request.method == "GET":
            return None
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return _gone_with_predecessor(pool) or error("unauthorized", "missing or wrong bearer token", 401)
        return None

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
        return ok(pool.create(body.job_id, body.spec, body.lease_s), 201)

    @app.get("/sandboxes")
    def list_sandboxes() -> Response:
        return ok(SandboxList(sandboxes=pool.entries()))

    @app.post("/sandboxes/<sandbox_id>/exec")
    def exec_(sandbox_id: str) -> Response:
        body = parse(ExecRequest)
        # waitress tells (channel_request_lookahead > 0) when the caller hung up, e.g. its
        # worker was killed: the command is interrupted and the sandbox's lease runs again.
        gone = request.environ.get("waitress.client_disconnected")
        return ok(pool.exec(sandbox_id, body.command, body.timeout, gone))

    @app.post("/sandboxes/<sandbox_id>/interrupt")
    def interrupt(sandbox_id: str) -> Response:
        with pool.using(sandbox_id) as sandbox:
            sandbox.interrupt()
        return Response(b'{"interrupted": true}', 200, mimetype="application/json")

    @app.post("/sandboxes/<sandbox_id>/renew")
    def renew(sandbox_id: str) -> Response:
        body = parse(RenewRequest)
        return ok(pool.renew(sandbox_id, body.lease_s))

    @app.put("/sandboxes/<sandbox_id>/files")
    def write_file(sandbox_id: str) -> Response:
        path = file_path()
        with pool.using(sandbox_id) as sandbox:
            sandbox.write_file(path, request.get_data())
        return Response(b'{"written": true}', 200, mimetype="application/json")

    @app.get("/sandboxes/<sandbox_id>/files")
    def read_file(sandbox_id: str) -> Response:
        path = file_path()
        with pool.using(sandbox_id) as sandbox:  # size-checked, then streamed (workspace.py)
            opened = sandbox.open_file(path) if hasattr(sandbox, "open_file") else None
            data = sandbox.read_file(path) if opened is None else stream_capped(opened)
        return Response(data, 200, mimetype="application/octet-stream")

    @app.put("/sandboxes/<sandbox_id>/tree")
    def put_tree(sandbox_id: str) -> Response:
        path = file_path()
        with pool.using(sandbox_id) as sandbox:
            members = sandbox.put_archive(path, request.stream)
        return Response(f'{{"members": {members}}}', 200, mimetype="application/json")

    @app.get("/sandboxes/<sandbox_id>/tree")
    def get_tree(sandbox_id: str) -> Response:
        path = file_path()
        buf = tempfile.SpooledTemporaryFile(64 << 20)
        try:
            with pool.using(sandbox_id) as sandbox:
                sandbox.get_archive(path, buf)
        except BaseException:
            buf.close()
            raise
        buf.seek(0)
        return Response(_chunks(buf), 200, mimetype="application/x-tar")

    @app.delete("/sandboxes/<sandbox_id>")
    def close(sandbox_id: str) -> Response:
        return ok(CloseResponse(closed=pool.close(sandbox_id)))

    @app.post("/sandboxes/close")
    def close_many() -> Response:  # a bulk cancel: one call instead of one per sandbox
        ids = parse(CloseManyRequest).sandbox_ids
        return ok(CloseManyResponse(closed=pool.close_many(ids, "closed in bulk")))

    return app


def _chunks(buf: IO[bytes]) -> Iterator[bytes]:
    with buf:
        while chunk := buf.read(1 << 20):
            yield chunk
