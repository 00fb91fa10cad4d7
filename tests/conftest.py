"""Shared fixtures: a private Redis, and the whole service started as real processes.

The Redis URL (with the private Redis's password) and the API token are fixed before any project
module is imported, so the Celery app and settings in this process and in every child process point
at the same private Redis. The stack's API requires the token like any other: requests made with
``requests`` to that API get the bearer header added here (``_with_token``), unless a test sets
its own ``Authorization`` header (an attack test sends none by other means).
"""
from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path

import pytest
import requests

from prorl_celery.ops.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
REDIS_PORT = free_port()
REGISTRY_PORT = free_port()  # the loopback image registry of tests/registry.py
REDIS_PASSWORD = secrets.token_urlsafe(24)
API_TOKEN = secrets.token_urlsafe(24)
os.environ["PRORL_REDIS_URL"] = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{REDIS_PORT}/0"
os.environ["PRORL_API_TOKEN"] = API_TOKEN
# PRORL_TEST_ROUTING_REDIS=1: the LLM routing on a Redis of its own (prorl_celery/llm/store.py) for
# the whole session, this process's and the stack's (e.g. tests/llm, the fair share tests).
ROUTING_PORT = free_port() if os.environ.get("PRORL_TEST_ROUTING_REDIS") == "1" else None
if ROUTING_PORT:
    os.environ["PRORL_ROUTING_URL"] = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{ROUTING_PORT}/0"
else:
    os.environ.pop("PRORL_ROUTING_URL", None)
TEST_ENV = {
    "PRORL_SWEEP_INTERVAL_S": "1",
    "PRORL_STAGE_LEASE_S": "3",
    "PRORL_STAGE_REQUEUE_AFTER_S": "5",
    "PRORL_CONSUMER_WATCHDOG_S": "2",
    "PRORL_PLUGIN_PACKAGES": "tests",  # the handlers in tests/handlers_for_tests.py
    "PRORL_ALLOW_LOCAL_RUNTIME": "1",  # the test operator allows 'local'; tests/security/test_policy.py does not
    "PRORL_REPO_SOURCE_DIRS": f"/tmp/pytest-of-{__import__('getpass').getuser()}",  # SWE fixtures in tmp_path
    "PRORL_HARBOR_TASK_DIRS": f"{ROOT / 'examples' / 'harbor'},/tmp/pytest-of-{__import__('getpass').getuser()}",
    "PRORL_SANDBOX_IMAGE_DIRS": f"/tmp/prorl-test-images-{REDIS_PORT}",  # made by test_policy.py
    "PRORL_SANDBOX_REGISTRIES": f"127.0.0.1:{REGISTRY_PORT}",  # tests/registry.py, plain HTTP
    "PRORL_SANDBOX_INSECURE_REGISTRIES": f"127.0.0.1:{REGISTRY_PORT}",
    "PRORL_SANDBOX_IMAGE_CACHE": f"/tmp/prorl-test-image-cache-{REDIS_PORT}",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
}
os.environ.update(TEST_ENV)

from prorl_celery.ops.launcher import Stack  # noqa: E402 - after the environment above

# the loopback image registry fixtures (registry, python_image); the unit tier's checks
pytest_plugins = ["tests.registry", "tests.unit_tier"]

_API_TOKENS: dict[str, str] = {}  # base URL of each API a test Stack started -> its token
_session_request = requests.Session.request
_start_api = Stack.start_api


def _with_token(self, method, url, *args, **kwargs):
    """``requests.Session.request`` that adds a Stack's token to requests aimed at that stack's
    API that carry no Authorization header of their own."""
    token = next((t for base, t in _API_TOKENS.items() if isinstance(url, str)
                  and (url == base or url.startswith(base + "/"))), None)
    if token and not args:
        headers = dict(kwargs.get("headers") or {})
        if not any(k.lower() == "authorization" for k in [*headers, *self.headers]):
            kwargs["headers"] = {**headers, "Authorization": f"Bearer {token}"}
    return _session_request(self, method, url, *args, **kwargs)


def _start_api_and_remember(self: Stack):
    child = _start_api(self)
    _API_TOKENS[self.api_url] = self.api_token
    return child


requests.Session.request = _with_token
Stack.start_api = _start_api_and_remember


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    from prorl_celery.ops.launcher import Stack, StackOptions

    stack = Stack(StackOptions(state_dir=tmp_path_factory.mktemp("redis"), persist=False,
                               redis_password=REDIS_PASSWORD, api_token=API_TOKEN))
    stack.start_redis(REDIS_PORT)
    assert stack.redis_url == os.environ["PRORL_REDIS_URL"]
    if ROUTING_PORT:
        assert stack.start_routing_redis(ROUTING_PORT) == os.environ["PRORL_ROUTING_URL"]
    yield stack.redis_url
    stack.stop()


@pytest.fixture(scope="session")
def stack(redis_url, tmp_path_factory):
    """Sandbox host, one worker per queue (init, run, eval, maint), beat and the API."""
    from prorl_celery.ops.launcher import Stack, StackOptions

    options = StackOptions(state_dir=tmp_path_factory.mktemp("stack"), redis_url=redis_url,
                           concurrency={"init": 4, "run": 8, "eval": 4, "maint": 1}, env=TEST_ENV,
                           api_token=API_TOKEN)
    with Stack(options) as running:
        yield running


@pytest.fixture(scope="session")
def api(stack) -> str:
    return stack.api_url


@pytest.fixture
def redis_client(redis_url):
    import redis

    return redis.Redis.from_url(redis_url)


def submit(api: str, instance: dict, **extra) -> str:
    resp = requests.post(f"{api}/jobs", json={"instance": instance, **extra}, timeout=30)
    assert resp.status_code == 202, resp.text
    return resp.json()["job_ids"][0]


def wait(api: str, job_id: str, timeout: float = 60.0) -> dict:
    resp = requests.get(f"{api}/jobs/{job_id}/wait", params={"timeout": timeout}, timeout=timeout + 10)
    assert resp.status_code == 200, f"job {job_id} not terminal after {timeout}s: {resp.text}"
    return resp.json()


def start_api(stack, log_dir: Path, name: str, **env: str):
    """A second API process on ``stack``'s service with ``env`` over the stack's environment;
    returns (child, url) once ``/healthz`` answers. The caller stops the child."""
    from prorl_celery.ops.procs import Child, wait_for

    port = free_port()
    child = Child(name, [sys.executable, "-m", "prorl_celery.ops.cli", "api", "--port", str(port)],
                  {**stack.env(), **env}, log_dir).start()
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(f"{url}/healthz"), 30, f"the API {name}", child=child)
    return child, url


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def wait_until(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def own_stack(state_dir: Path, **options):
    """A whole stack with a Redis of its own (``options``: StackOptions fields, ``env`` added to
    TEST_ENV), started; the caller stops it (``with own_stack(...) as stack``)."""
    import contextlib

    from prorl_celery.ops.launcher import StackOptions

    @contextlib.contextmanager
    def running():
        opts = StackOptions(state_dir=state_dir, **{**options, "env": {**TEST_ENV, **options.get("env", {})}})
        stack = Stack(opts)
        stack.start_redis(free_port())
        opts.env["PRORL_REDIS_URL"] = stack.redis_url
        try:
            stack.start()
            yield stack
        finally:
            stack.stop()
    return running()

