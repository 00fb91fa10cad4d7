"""The host's hot routes (create, exec, close: sandboxes/host/hot.py) answer as the Flask app's
routes do, byte for byte, without entering Flask; every other request still goes to Flask."""
from __future__ import annotations

import json

import pytest
from werkzeug.test import EnvironBuilder

from sandboxes.host.app import create_app
from sandboxes.host.pool import SandboxPool

TOKEN = "hot-token"


@pytest.fixture
def host(tmp_path):
    pool = SandboxPool("hot-test", 4, 60.0, runtime_config={"local": {"root": str(tmp_path)}})
    app = create_app(pool, TOKEN)
    entered: list[str] = []
    app.before_request_funcs.setdefault(None, []).insert(0, lambda: entered.append("flask") and None)
    yield app, pool, entered
    pool.close_all()


def call(wsgi, method: str, path: str, body: bytes | None = b"{}", token: str | None = TOKEN,
         query: str = "") -> tuple[str, list[tuple[str, str]], bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    environ = EnvironBuilder(path=path, method=method, data=body, headers=headers,
                             query_string=query).get_environ()
    answer: dict = {}

    def start_response(status, response_headers, exc_info=None):
        answer["status"], answer["headers"] = status, list(response_headers)

    out = b"".join(wsgi(environ, start_response))
    return answer["status"], answer["headers"], out


def both(app, *args, **kwargs):
    """The hot answer and the Flask routes' answer to the same request."""
    return call(app.wsgi_app, *args, **kwargs), call(app.wsgi_app.fallback, *args, **kwargs)


@pytest.mark.parametrize("method, path, body, token", [
    ("POST", "/sandboxes", b"{}", TOKEN),  # no job_id: invalid_request
    ("POST", "/sandboxes", b"not json", TOKEN),
    ("POST", "/sandboxes", json.dumps({"job_id": "j", "spec": {"runtime": "singularity"}}).encode(), TOKEN),
    ("POST", "/sandboxes", b"{}", None),  # no token: 401
    ("POST", "/sandboxes", b"{}", "wrong"),
    ("POST", "/sandboxes/0123456789abcdef/exec", json.dumps({"command": "true"}).encode(), TOKEN),
    ("POST", "/sandboxes/0123456789abcdef/exec", json.dumps({"command": "true"}).encode(), "wrong"),  # gone
    ("POST", "/sandboxes/0123456789abcdef/exec", b"{}", TOKEN),  # no command
    ("POST", "/sandboxes/0123456789abcdef/close", b"", TOKEN),
    ("POST", "/sandboxes/0123456789abcdef/close", None, TOKEN),
])
def test_errors_are_the_apps_byte_for_byte_without_flask(host, method, path, body, token):
    app, _pool, entered = host
    hot, flask = both(app, method, path, body, token)
    assert hot == flask and hot[0].split()[0] in {"200", "400", "401", "403", "404", "410"}
    assert entered == ["flask"]  # the fallback's call only


def test_a_cycle_through_the_hot_routes_answers_as_the_app(host):
    app, pool, entered = host
    spec = json.dumps({"job_id": "job-hot", "spec": {"runtime": "local"}}).encode()
    status, headers, body = call(app.wsgi_app, "POST", "/sandboxes", spec)
    assert status == "201 CREATED" and headers == [("Content-Type", "application/json"),
                                                   ("Content-Length", str(len(body)))]
    first = json.loads(body)["sandbox_id"]
    second = json.loads(call(app.wsgi_app.fallback, "POST", "/sandboxes", spec)[2])["sandbox_id"]
    command = json.dumps({"command": "echo hi; exit 3"}).encode()
    hot, flask = (call(wsgi, "POST", f"/sandboxes/{sid}/exec", command)
                  for wsgi, sid in ((app.wsgi_app, first), (app.wsgi_app.fallback, second)))
    assert (hot[0], hot[1][0]) == (flask[0], flask[1][0]) == ("200 OK", ("Content-Type", "application/json"))
    strip = [{k: v for k, v in json.loads(out).items() if k != "duration_s"} for out in (hot[2], flask[2])]
    assert strip[0] == strip[1] and strip[0]["output"] == "hi\n" and strip[0]["exit_code"] == 3
    closed = [call(wsgi, "POST", f"/sandboxes/{sid}/close", b"")
              for wsgi, sid in ((app.wsgi_app, first), (app.wsgi_app.fallback, second))]
    assert closed[0] == closed[1] and json.loads(closed[0][2]) == {"closed": True, "usage": None}
    assert entered == ["flask"] * 3 and pool.live == 0
    # a hot route with a query string, and every other route, is Flask's
    assert call(app.wsgi_app, "POST", f"/sandboxes/{first}/exec", command, query="timeout=5")[0] == "400 BAD REQUEST"
    assert call(app.wsgi_app, "GET", "/sandboxes", None)[0] == "200 OK"
    assert entered == ["flask"] * 5


def test_an_unexpected_error_is_flasks_500(host, monkeypatch):
    app, pool, _entered = host

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(pool, "exec", broken)
    monkeypatch.setattr(pool, "close_measured", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError(2, "gone", "x")))
    hot, flask = both(app, "POST", "/sandboxes/0123456789abcdef/exec", json.dumps({"command": "true"}).encode())
    assert hot == flask and hot[0] == "500 INTERNAL SERVER ERROR"
    hot, flask = both(app, "POST", "/sandboxes/0123456789abcdef/close", b"")
    assert hot == flask and json.loads(hot[2])["error"]["type"] == "file_not_found"
