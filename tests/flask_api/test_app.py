"""The API in process: ``create_app()`` and Flask's test client, on the session's private Redis.

The answers a trainer gets before any job exists: refusals that name the field, the token check,
the caps on long polls and bodies, unknown ids, the OpenAPI document. Nothing here submits a
job (the session's Redis is the stack's too, whose workers would run it); each refusal of a
submission is checked not to have reached the store. ``test_service.py`` and ``test_instance_checks.py``
send the same requests over real HTTP to the running service."""
from __future__ import annotations

import json
import os

import pytest

from tests.flask_api.test_instance_checks import BAD

pytestmark = pytest.mark.unit
TOKEN = {"Authorization": f"Bearer {os.environ['PRORL_API_TOKEN']}"}


# bodies /jobs refuses, and the field each refusal names (also sent over HTTP: test_service.py)
BAD_BODIES = [
    ({"instance": {"commands": ["true"]}}, "instance"),
    ({"instance": {"data_source": ""}}, "instance"),
    ({"instance": {"data_source": "no-such-domain"}}, "instance.data_source"),
    ({"instance": {"data_source": "shell"}, "job_id": "bad id with spaces"}, "job_id"),
    ({"instance": {"data_source": "shell"}, "surprise": 1}, "surprise"),
    ({"sampling_params": {}}, "instance"),
    ({"jobs": []}, "jobs"),
    ({"jobs": [{"instance": {"data_source": "shell"}}, {"instance": 3}]}, "jobs.1.instance"),
    ({"jobs": [{"instance": {"data_source": "shell"}, "job_id": "a"},
               {"instance": {"data_source": "shell"}, "job_id": "a"}]}, "jobs"),
    # refused at submission, not when the run stage starts (issue 32)
    ({"instance": {"data_source": "shell"}, "sampling_params": {"max_staleness": -1}}, "sampling_params.max_staleness"),
    ({"instance": {"data_source": "shell"}, "sampling_params": {"max_staleness": "2"}}, "sampling_params.max_staleness"),
    ({"instance": {"data_source": "shell"}, "sampling_params": {"max_staleness": True}}, "sampling_params.max_staleness"),
    ({"jobs": [{"instance": {"data_source": "shell"}},
               {"instance": {"data_source": "shell"}, "sampling_params": {"max_staleness": 1.5}}]},
     "jobs.1.sampling_params.max_staleness"),
]


@pytest.fixture(scope="module")
def app(redis_url):
    """One app for the module: each app's first wait starts a thread that follows the completion
    stream for the rest of the process."""
    from flask_api import create_app

    return create_app({"TESTING": True})


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def nothing_stored(monkeypatch):
    """Asserts, after the test, that the API never went on to store and enqueue a job."""
    import flask_api.jobs

    calls, submit = [], flask_api.jobs.submit

    def recorded(*args, **kwargs):
        calls.append(args)
        return submit(*args, **kwargs)
    monkeypatch.setattr(flask_api.jobs, "submit", recorded)
    yield
    assert calls == []


def refusal(resp, status: int) -> dict:
    assert resp.status_code == status, resp.get_data(as_text=True)
    assert resp.is_json, resp.get_data(as_text=True)
    error = resp.get_json()["error"]
    assert error["type"] and error["message"], error
    return error


@pytest.mark.parametrize("body,field", [
    *BAD_BODIES,
    ({"instance": {"data_source": "shell", "x": json.loads("[" * 150 + "]" * 150)}}, "body"),
])
def test_bad_bodies_are_400_naming_the_field(client, nothing_stored, body, field):
    error = refusal(client.post("/jobs", json=body, headers=TOKEN), 400)
    assert (error["type"], error["field"]) == ("invalid_request", field)


def test_a_job_may_only_narrow_the_operators_staleness_bound(client, nothing_stored, monkeypatch):
    """With ``PRORL_MAX_STALENESS`` 2, a job's null (no bound) or 3 is refused at submission as
    the operator's policy (403 naming the field), on every way in; 0..2 or none passes; and the
    run stage's backstop never lets a stored job run wider than the operator's bound."""
    from config.settings import get_settings
    from prorl_celery.staleness import check_max_staleness, effective_max_staleness

    monkeypatch.setattr(get_settings(), "max_staleness", 2)
    shell = {"data_source": "shell", "commands": ["true"]}
    for asked in (None, 3):
        params = {"max_staleness": asked}
        for path, body, field in (
                ("/jobs", {"instance": shell, "sampling_params": params}, "sampling_params.max_staleness"),
                ("/jobs", {"jobs": [{"instance": shell}, {"instance": shell, "sampling_params": params}]},
                 "jobs.1.sampling_params.max_staleness"),
                ("/groups", {"instance": shell, "n": 2, "sampling_params": params}, "sampling_params.max_staleness")):
            error = refusal(client.post(path, json=body, headers=TOKEN), 403)
            assert (error["type"], error["field"]) == ("policy_denied", field) and "at most 2" in error["message"]
    for allowed in ({}, {"max_staleness": 0}, {"max_staleness": 2}):
        check_max_staleness(allowed)
    assert [effective_max_staleness(p) for p in ({}, {"max_staleness": None}, {"max_staleness": 1},
                                                 {"max_staleness": 7})] == [2, 2, 1, 2]
    monkeypatch.setattr(get_settings(), "max_staleness", None)  # no operator bound: the job's own, null included
    check_max_staleness({"max_staleness": None})
    assert [effective_max_staleness(p) for p in ({}, {"max_staleness": None}, {"max_staleness": 7})] == [None, None, 7]


@pytest.mark.parametrize("instance,status,field", BAD)
def test_instances_the_policy_or_the_handler_refuses_name_the_field(client, nothing_stored, instance, status,
                                                                    field):
    error = refusal(client.post("/jobs", json={"instance": instance}, headers=TOKEN), status)
    assert error["field"] == field and error["type"] in ("invalid_request", "policy_denied")


@pytest.mark.parametrize("source,reason", [
    ("os:abort", "none of the allowed packages"), ("subprocess.Popen", "none of the allowed packages"),
    ("tests.handlers_for_tests:Nope", "cannot load handler"),
    ("sandboxes.host.__main__:SandboxHost", "never a __main__ module")])
def test_a_data_source_cannot_name_arbitrary_code(client, nothing_stored, source, reason):
    error = refusal(client.post("/jobs", json={"instance": {"data_source": source}}, headers=TOKEN), 400)
    assert error["field"] == "instance.data_source" and reason in error["message"]


def test_a_body_that_is_not_json_or_too_large_is_refused_as_json(redis_url, nothing_stored):
    from flask_api import create_app

    app = create_app({"TESTING": True})
    client = app.test_client()
    error = refusal(client.post("/jobs", data="not json", headers={**TOKEN, "Content-Type": "text/plain"}), 400)
    assert error["type"] == "invalid_request" and "JSON" in error["message"]
    app.config["MAX_CONTENT_LENGTH"] = 1024
    big = json.dumps({"instance": {"data_source": "shell", "commands": ["x" * 2048]}})
    assert refusal(client.post("/jobs", data=big, headers={**TOKEN, "Content-Type": "application/json"}),
                   413)["type"] == "request_entity_too_large"


@pytest.mark.parametrize("header", [None, "Bearer wrong-token", "Basic " + "x" * 24, "Bearer ",
                                    b"Bearer \xc3\xa9t\xc3\xa9".decode("latin-1"), "Bearer " + "é" * 40])
def test_every_route_but_the_probe_needs_the_token(client, header):
    headers = {"Authorization": header} if header is not None else {}
    for method, path in (("GET", "/jobs/x"), ("POST", "/jobs"), ("GET", "/openapi.json"),
                         ("POST", "/llm_servers"), ("GET", "/completions")):
        error = refusal(client.open(path, method=method, headers=headers, json={}), 401)
        assert error["type"] == "unauthorized" and ("no 'Authorization" in error["message"]) == (
            header is None or not header.startswith("Bearer") or header == "Bearer "), (method, path, header)


def test_an_app_without_a_configured_token_refuses_everyone(redis_url):
    from flask_api import create_app

    client = create_app({"API_TOKEN": ""}).test_client()
    assert refusal(client.get("/jobs/x", headers={"Authorization": "Bearer "}), 401)["type"] == "unauthorized"
    assert refusal(client.get("/jobs/x", headers=TOKEN), 401)["type"] == "unauthorized"


def test_unknown_ids_are_404(client):
    for method, path in (("GET", "/jobs/nope"), ("GET", "/jobs/nope/wait?timeout=0"), ("DELETE", "/jobs/nope"),
                         ("GET", "/groups/nope"), ("GET", "/llm_servers/nope")):
        error = refusal(client.open(path, method=method, headers=TOKEN), 404)
        assert error["type"] == "not_found", (method, path)


@pytest.mark.parametrize("timeout", ["abc", "-1", "1e9", "nan"])
def test_a_wait_timeout_out_of_range_is_400_naming_it(client, timeout):
    error = refusal(client.get(f"/jobs/nope/wait?timeout={timeout}", headers=TOKEN), 400)
    assert error["field"] == "timeout"


def test_a_long_poll_over_the_clients_cap_is_429_at_once(redis_url):
    from flask_api import create_app

    app = create_app({"MAX_STREAMS_PER_CLIENT": 0})
    error = refusal(app.test_client().get("/jobs/nope/wait?timeout=5", headers=TOKEN), 429)
    assert error["type"] == "too_many_requests" and "limit 0" in error["message"]
    assert app.extensions["prorl_streams"].held == 0
    assert refusal(app.test_client().get("/jobs/nope", headers=TOKEN), 404)  # the client is not refused otherwise


@pytest.mark.parametrize("body,field", [({}, "address"), ({"address": "http://127.0.0.1:1", "protocol": "telnet"},
                                                          "protocol"),
                                        ({"address": "http://127.0.0.1:1", "capacity": 0}, "capacity"),
                                        ({"address": "http://127.0.0.1:1", "protocol": "generate"}, "dialect"),
                                        ({"address": "http://127.0.0.1:1", "tool_parser": "nope"}, "tool_parser")])
def test_a_bad_llm_server_registration_is_400_naming_the_field(client, body, field):
    error = refusal(client.post("/llm_servers", json={"probe": False, **body}, headers=TOKEN), 400)
    assert error["field"] == field


def test_the_document_lists_every_route_of_the_app(app, client):
    doc = client.get("/openapi.json", headers=TOKEN).get_json()
    assert doc["openapi"].startswith("3.")
    documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    routes = {(method, rule.rule.replace("<", "{").replace(">", "}"))
              for rule in app.url_map.iter_rules() if rule.endpoint != "static"
              for method in rule.methods - {"HEAD", "OPTIONS"}}
    assert routes and routes - documented == set()
    assert doc["components"]["schemas"]["ErrorBody"]


@pytest.mark.parametrize("linger", ["-1", "abc", "60"])
def test_a_completions_linger_out_of_range_is_refused_naming_it(client, linger):
    error = refusal(client.get(f"/completions?cursor=0-0&linger={linger}", headers=TOKEN), 400)
    assert error["field"] == "linger"


def test_a_completions_linger_in_range_is_taken(client):
    assert client.get("/completions?cursor=0-0&linger=0.01", headers=TOKEN).status_code == 200
