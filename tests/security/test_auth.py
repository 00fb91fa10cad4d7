"""The API's bearer token: required on loopback too, compared as bytes, the API refuses to start
without one. Attacks go through http.client, not through the suite's token-adding hook."""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
import uuid
from urllib.parse import urlsplit

import redis
import requests

from prorl_celery import keys
from prorl_celery.ops.procs import free_port
from tests.conftest import start_api


def raw(url: str, method: str, path: str, headers: dict[str, bytes | str] | None = None,
        body: dict | None = None) -> tuple[int, dict]:
    """One request as an attacker would send it: no hook adds a token; header bytes as given."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.putrequest(method, path)
        data = json.dumps(body).encode() if body is not None else b""
        for name, value in {**(headers or {}), "Content-Type": "application/json",
                            "Content-Length": str(len(data))}.items():
            conn.putheader(name, value)
        conn.endheaders(data)
        resp = conn.getresponse()
        text = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, {"raw": text.decode(errors="replace")}


def test_loopback_api_refuses_unauthenticated_root_job(stack, api):
    """Row 3: from any local user (or a network sandbox), POST /jobs with the local runtime
    on the loopback API. It is refused and no job exists afterwards."""
    job_id = f"attack-{uuid.uuid4().hex[:8]}"
    body = {"job_id": job_id, "instance": {"data_source": "shell", "commands": ["id > /tmp/pwned"],
                                            "sandbox": {"runtime": "local"}}}
    assert urlsplit(api).hostname == "127.0.0.1"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + stack.api_token},
                    {"Authorization": "Bearer"}, {"Authorization": stack.api_token}):
        status, reply = raw(api, "POST", "/jobs", headers, body)
        assert status == 401 and reply["error"]["type"] == "unauthorized", (headers, status, reply)
    assert raw(api, "GET", f"/jobs/{job_id}")[0] == 401
    ok = raw(api, "GET", f"/jobs/{job_id}", {"Authorization": f"Bearer {stack.api_token}"})
    assert ok[0] == 404, ok  # authenticated: the job was never created
    assert raw(api, "GET", "/healthz")[0] == 200  # probes stay open


def test_non_ascii_token_is_401_json_not_500(stack, api):
    """Row 16: compare_digest on str raised TypeError for a non-ASCII token -> 500."""
    for value in (b"Bearer \xc3\xa9t\xc3\xa9", b"Bearer \xff\xfe", "Bearer " + "é" * 40,
                  b"Bearer " + stack.api_token.encode() + b"\xe9"):
        status, reply = raw(api, "GET", "/jobs/x", {"Authorization": value})
        assert status == 401 and reply["error"]["type"] == "unauthorized", (value, status, reply)


def test_sandbox_host_non_ascii_token_is_401(stack, redis_url):
    """The sandbox host's own check compares bytes too (its token is in Redis, which needs the
    password)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    host_id = client.zrange(keys.hosts(), 0, 0)[0]
    address = client.hget(keys.host(host_id), "address")
    for value in (b"Bearer \xc3\xa9", b"Bearer \xff"):
        status, reply = raw(address, "GET", "/sandboxes", {"Authorization": value})
        assert status == 401 and reply["error"]["type"] == "unauthorized", (status, reply)


def test_token_is_required_and_checked(stack, tmp_path):
    child, url = start_api(stack, tmp_path, "api-token", PRORL_API_TOKEN="s3cret-token")
    try:
        assert requests.get(f"{url}/jobs/x", timeout=5).status_code == 401
        wrong = requests.get(f"{url}/jobs/x", headers={"Authorization": "Bearer nope"}, timeout=5)
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "unauthorized"
        posted = requests.post(f"{url}/jobs", json={"instance": {"data_source": "shell"}}, timeout=5)
        assert posted.status_code == 401
        right = requests.get(f"{url}/jobs/x", headers={"Authorization": "Bearer s3cret-token"}, timeout=5)
        assert right.status_code == 404  # authenticated: now it is just an unknown job
        assert requests.get(f"{url}/healthz", timeout=5).status_code == 200  # probes stay open
    finally:
        child.stop()


def test_api_refuses_to_start_without_a_token_even_on_loopback(stack):
    env = {k: v for k, v in stack.env().items() if k != "PRORL_API_TOKEN"}
    for host in ("127.0.0.1", "0.0.0.0"):
        done = subprocess.run([sys.executable, "-m", "prorl_celery.ops.cli", "api", "--host", host,
                               "--port", str(free_port())], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2 and "PRORL_API_TOKEN" in done.stderr, (host, done.stderr)


def test_request_size_limit(api):
    big = "x" * (65 * 1024 * 1024)
    resp = requests.post(f"{api}/jobs", data=big, headers={"Content-Type": "application/json"}, timeout=60)
    assert resp.status_code == 413




def test_a_request_cannot_name_arbitrary_code(api):
    """A data source or sandbox runtime by dotted path loads only classes from allowed packages
    (the service's own, and ``PRORL_PLUGIN_PACKAGES``, which the tests set to ``tests``)."""
    from tests.conftest import submit, wait

    for source, reason in [("os:abort", "none of the allowed packages"),
                           ("subprocess.Popen", "none of the allowed packages"),
                           ("tests.handlers_for_tests:annotations", "defines no class"),
                           ("tests.handlers_for_tests:Nope", "cannot load handler"),
                           ("sandboxes.host.__main__:SandboxHost", "never a __main__ module"),
                           ("sandboxes.host.main:SandboxHost", "its source shows no eval, init")]:
        resp = requests.post(f"{api}/jobs", json={"instance": {"data_source": source}}, timeout=10)
        assert resp.status_code == 400, (source, resp.text)
        error = resp.json()["error"]
        assert error["field"] == "instance.data_source" and reason in error["message"], (source, error)
    assert requests.get(f"{api}/healthz", timeout=10).json()["ok"]  # the API did not call os.abort
    job_id = submit(api, {"data_source": "shell", "commands": ["true"], "sandbox": {"runtime": "os:system"}})
    result = wait(api, job_id)["result"]
    assert result["status"] == "failed" and "none of the allowed packages" in result["error"]["message"]
