"""The one error registry: every type on the wire keeps its status, and crosses each server and
the sandbox client as the same class (prorl_celery/errors.py). Real servers over real HTTP: the
sandbox host's app and the API's error handlers, served by werkzeug in a thread."""
from __future__ import annotations

import ast
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from flask import Flask, Response
from werkzeug.serving import make_server

from flask_api import errors as api_errors
from prorl_celery import errors
from prorl_celery.errors import (FileDenied, FileError, FileMissing, JobAlreadyTerminal,
                                 ProrlError, SandboxError)
from sandboxes.client import request
from sandboxes.host.app import create_app
from sandboxes.host.pool import SandboxPool

TOKEN = "test-token"
# Every type string on the wire and its status, as the servers answered before the registry
# (host_app.STATUS_BY_TYPE, flask_api/errors._STATUS, compat's 504 "timeout"); the other types
# were 500. A new error class is a new row here: a decision, not an accident.
WIRE = {
    "error": 500, "invalid_request": 400, "policy_denied": 403, "job_id_conflict": 409, "task_quarantined": 409, "image_error": 400,
    "image_not_found": 404, "image_unavailable": 424, "image_too_large": 413, "not_found": 404,
    "conflict": 409, "cancelled": 500, "timeout": 504, "unknown_plugin": 400, "file_error": 400,
    "file_not_found": 404, "permission_denied": 403, "file_too_large": 413, "sandbox": 500,
    "no_sandbox_capacity": 503, "sandbox_gone": 404, "env_build_failed": 500, "image_build_failed": 500,
    "unsafe_directory": 500, "too_many_requests": 429, "over_quota": 429, "store_unavailable": 503,
    "store_layout_mismatch": 500,
    "rollout_failed": 500,
    "llm": 500,
    "backend_failed": 500, "logprob_mismatch": 500, "backend_aborted": 500, "partial_aborted": 500,
    "backend_unavailable": 500, "context_window_exceeded": 500, "llm_timeout": 500,
    "llm_request_rejected": 500, "quota_exceeded": 413,
    "verifier_failed": 500, "verifier_timeout": 500, "verifier_no_reward": 500, "sidecar_failed": 500,
}


def _all_classes(root: type[ProrlError] = ProrlError) -> Iterator[type[ProrlError]]:
    yield root
    for sub in root.__subclasses__():
        if sub.__module__ != __name__:
            yield from _all_classes(sub)


@pytest.fixture(scope="module")
def serve() -> Iterator:
    servers = []

    def start(app: Flask) -> str:
        server = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()


def _raiser(app: Flask) -> Flask:
    """Add a route raising the class of a wire type (or a built-in OSError) to a real app."""
    builtins = {"FileNotFoundError": FileNotFoundError(2, "No such file or directory", "x.txt"),
                "PermissionError": PermissionError("outside the workspace"),
                "IsADirectoryError": IsADirectoryError(21, "is a directory", "sub")}

    def raise_(type_: str) -> Response:
        if type_ in builtins:
            raise builtins[type_]
        raise errors.error_class(type_).rebuild(f"boom {type_}", field="spec.x")

    def odd(status: int) -> Response:  # a body from a newer server, and one that is not a body
        if status == 418:
            return Response('{"error": {"type": "brand_new_kind", "message": "m", "extra": 1}}',
                            418, mimetype="application/json")
        return Response("<html>bad gateway</html>", status, mimetype="text/html")

    app.add_url_rule("/raise/<type_>", view_func=raise_)
    app.add_url_rule("/odd/<int:status>", view_func=odd)
    return app


@pytest.fixture(scope="module")
def host(serve) -> str:
    return serve(_raiser(create_app(SandboxPool("errors-test", 1, 60.0), TOKEN)))


@pytest.fixture(scope="module")
def api(serve) -> str:
    app = Flask("api-errors-test")
    app.config["API_TOKEN"] = TOKEN
    api_errors.init_app(app)

    @app.delete("/conflict")
    def conflict() -> Response:
        raise JobAlreadyTerminal("j1", "cancelled")

    return serve(_raiser(app))


@pytest.mark.unit
def test_every_class_is_registered_with_the_status_pinned():
    classes = list(_all_classes())
    assert {cls.type for cls in classes} == set(WIRE), "a class without a row in WIRE, or the reverse"
    for cls in classes:
        assert cls.http_status == WIRE[cls.type], cls
        assert issubclass(cls, errors.error_class(cls.type)), cls  # the most general one sharing it
    assert {t: errors.error_class(t).http_status for t in WIRE} == WIRE


def test_errors_alone_knows_every_type():
    """Every wire class lives in prorl_celery/errors.py: a process that imports nothing else (a
    trainer's client, a worker that never loaded the module raising one) knows every type."""
    code = "import sys, prorl_celery.errors as e\nprint(sorted(e._REGISTRY), sorted(m for m in sys.modules if m.split('.')[0] in ('flask_api', 'sandboxes', 'tasks')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == f"{sorted(WIRE)} []"


def _raises_in(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
                isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "type" for t in stmt.targets)
                and any(getattr(b, "id", "").endswith(("Error", "Failed")) for b in node.bases)
                for stmt in node.body):
            yield node.name


@pytest.mark.unit
def test_no_error_class_with_a_wire_type_outside_errors_py():
    root = Path(errors.__file__).resolve().parent.parent
    found = {f"{path.relative_to(root)}:{name}"
             for package in ("prorl_celery", "sandboxes", "tasks", "flask_api")
             for path in (root / package).rglob("*.py") if path.name != "errors.py" or path.parent.name != "prorl_celery"
             for name in _raises_in(ast.parse(path.read_text()))}
    assert found == set()


@pytest.mark.unit
def test_error_body_is_the_shape_of_to_dict():
    assert errors.error_body("unauthorized", "no token") == {"error": {"type": "unauthorized", "message": "no token"}}
    exc = errors.InvalidRequest("bad n", field="n")
    assert errors.error_body(exc.type, str(exc), exc.field) == {"error": exc.to_dict()}
    assert errors.ErrorBody.model_validate(errors.error_body("x", "m", status="done")).error.status == "done"


@pytest.mark.parametrize("type_", sorted(WIRE))
def test_round_trip_host_to_client_is_the_same_class(host, type_):
    with pytest.raises(ProrlError) as caught:
        request("GET", host, TOKEN, f"/raise/{type_}", 10)
    exc = caught.value
    assert type(exc) is errors.error_class(type_) and exc.type == type_
    assert str(exc) == f"boom {type_} (HTTP {WIRE[type_]})" and exc.field == "spec.x"
    assert exc.remote_type is None


@pytest.mark.parametrize("type_", sorted(WIRE))
def test_api_answers_the_class_status(api, type_):
    reply = requests.get(f"{api}/raise/{type_}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert reply.status_code == WIRE[type_]  # as the sandbox host answers: one status per type
    body = reply.json()["error"]
    assert body["type"] == type_ and body["message"] == f"boom {type_}" and body["field"] == "spec.x"


def test_conflict_says_the_job_status(api):
    reply = requests.delete(f"{api}/conflict", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert reply.status_code == 409
    assert reply.json() == {"error": {"type": "conflict", "status": "cancelled",
                                      "message": "job 'j1' already ended with status 'cancelled'"}}


@pytest.mark.parametrize("name, cls, status", [("FileNotFoundError", FileMissing, 404),
                                               ("PermissionError", FileDenied, 403),
                                               ("IsADirectoryError", FileError, 400)])
def test_builtin_file_errors_cross_as_their_kind(host, name, cls, status):
    reply = requests.get(f"{host}/raise/{name}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert reply.status_code == status and reply.json()["error"]["type"] == cls.type
    with pytest.raises(OSError) as caught:  # callers still catch the built-in
        request("GET", host, TOKEN, f"/raise/{name}", 10)
    assert type(caught.value) is cls and name in str(caught.value)
    assert not isinstance(caught.value, SandboxError)  # task-level: never retried as infrastructure


def test_unknown_type_becomes_the_generic_sandbox_error(host):
    with pytest.raises(SandboxError) as caught:
        request("GET", host, TOKEN, "/odd/418", 10)
    assert type(caught.value) is SandboxError and caught.value.remote_type == "brand_new_kind"
    assert str(caught.value) == "m (HTTP 418)"
    with pytest.raises(SandboxError) as caught:
        request("GET", host, TOKEN, "/odd/502", 10)
    assert type(caught.value) is SandboxError and "bad gateway" in str(caught.value)


def test_framework_errors_keep_their_shape(host, api):
    """Not the service's own errors, but the same body: no token (401), no route (404, 405)."""
    for base, message in ((host, "missing or wrong bearer token"),
                          (api, api_errors.NO_TOKEN)):
        reply = requests.get(f"{base}/raise/sandbox", timeout=10)
        assert reply.status_code == 401 and reply.json() == {"error": {"type": "unauthorized",
                                                                        "message": message}}
    assert requests.get(f"{host}/nowhere", headers={"Authorization": f"Bearer {TOKEN}"},
                        timeout=10).json()["error"]["type"] == "not_found"
    with pytest.raises(errors.NotFound):
        request("GET", host, TOKEN, "/nowhere", 10)


@pytest.mark.unit
def test_a_taken_type_is_refused():
    with pytest.raises(TypeError, match="is SandboxError's"):
        class Clash(ProrlError):
            type = "sandbox"
    with pytest.raises(TypeError, match="its status 404"):
        class Sooner(errors.SandboxGone):
            type = "sandbox_gone"
            http_status = 410
    assert errors.error_class("sandbox") is SandboxError


@pytest.mark.unit
def test_openapi_lists_the_error_schema_once():
    from flask_api.openapi import build_document

    schemas = build_document(60.0, token=True)["components"]["schemas"]
    shaped = {name for name, schema in schemas.items()
              if {"type", "message"} <= set(schema.get("properties", {}))}
    assert shaped == {"ErrorDetail", "ErrorInfo"}  # ErrorInfo: a job result's error, not an answer's
    assert "ErrorResponse" not in schemas
    assert schemas["ErrorBody"]["properties"]["error"] == {"$ref": "#/components/schemas/ErrorDetail"}


def test_the_running_api_answers_a_policy_refusal_403_like_the_host(stack):
    """The same type, the same status, on the real API: a sandbox image outside the operator's
    image directories is forbidden, not malformed."""
    instance = {"data_source": "shell", "commands": ["true"], "sandbox": {"runtime": "bwrap", "image": "/etc"}}
    reply = requests.post(f"{stack.api_url}/jobs", json={"instance": instance}, timeout=10)
    assert reply.status_code == 403, reply.text
    assert reply.json()["error"]["type"] == "policy_denied"
    assert reply.json()["error"]["field"] == "instance.sandbox.image"
