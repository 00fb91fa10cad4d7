"""The API's bearer token, and refusing to listen beyond loopback without one."""
from __future__ import annotations

import subprocess
import sys

import requests

from prorl_celery.procs import Child, free_port, wait_for


def test_token_is_required_when_set(stack, tmp_path):
    port = free_port()
    env = {**stack.env(), "PRORL_API_TOKEN": "s3cret-token"}
    child = Child("api-token", [sys.executable, "-m", "prorl_celery.cli", "api", "--port", str(port)],
                  env, tmp_path).start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _up(f"{url}/healthz"), 30, "the API", child=child)
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


def test_no_token_refuses_non_loopback(stack):
    env = {k: v for k, v in stack.env().items() if k != "PRORL_API_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "prorl_celery.cli", "api", "--host", "0.0.0.0",
                           "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "PRORL_API_TOKEN" in done.stderr


def test_request_size_limit(api):
    big = "x" * (65 * 1024 * 1024)
    resp = requests.post(f"{api}/jobs", data=big, headers={"Content-Type": "application/json"}, timeout=60)
    assert resp.status_code == 413


def _up(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def test_a_request_cannot_name_arbitrary_code(api):
    """A data source or sandbox runtime by dotted path loads only classes from allowed packages
    (the service's own, and ``PRORL_PLUGIN_PACKAGES``, which the tests set to ``tests``)."""
    from tests.conftest import submit, wait

    for source, reason in [("os:abort", "none of the allowed packages"),
                           ("subprocess.Popen", "none of the allowed packages"),
                           ("tests.handlers_for_tests:annotations", "is not a class"),
                           ("tests.handlers_for_tests:Nope", "cannot load handler")]:
        resp = requests.post(f"{api}/jobs", json={"instance": {"data_source": source}}, timeout=10)
        assert resp.status_code == 400, (source, resp.text)
        error = resp.json()["error"]
        assert error["field"] == "instance.data_source" and reason in error["message"], (source, error)
    assert requests.get(f"{api}/healthz", timeout=10).json()["ok"]  # the API did not call os.abort
    job_id = submit(api, {"data_source": "shell", "commands": ["true"], "sandbox": {"runtime": "os:system"}})
    result = wait(api, job_id)["result"]
    assert result["status"] == "failed" and "none of the allowed packages" in result["error"]["message"]
