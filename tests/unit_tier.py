"""The fast tier (``pytest -m unit``): what a test marked ``unit`` may and may not do, checked.

A ``unit`` test runs in this process: the agent loop, routing decisions, graders, parsers,
handlers on a fake stage context (``tasks/fake.py``), the API through
``create_app()`` and Flask's test client. It may use the session's private Redis (one
redis-server, started once: the routing decisions are Lua scripts that run in it); it starts no
stack, worker, sandbox, server or other process, and connects nowhere else.

That is enforced, not hoped for, wherever a ``unit`` test runs (in ``-m unit`` and in the
default suite alike), so the marker cannot go stale:

- at collection, a ``unit`` test that asks for a fixture which starts real parts, or that also
  carries a marker the default suite deselects (``-m unit`` replaces addopts' ``-m``: a slow test
  marked ``unit`` would run in the fast tier), is a usage error naming the test;
- while it runs, starting a process or connecting a socket anywhere but the session's Redis, from
  the test's own thread, fails the test, naming what it tried. Other threads pass: in the default
  suite the stack's supervisor (a thread of this process) may restart a worker meanwhile. The one
  process allowed is the math grader's own worker (:mod:`tasks.verify.math_pool`): checking a
  hostile answer in a capped process *is* the grader.
"""
from __future__ import annotations

import os
import socket
import subprocess
import threading

import pytest

# fixtures that start real parts (processes, servers, sandboxes): never in a unit test
HEAVY_FIXTURES = frozenset({
    "stack", "api", "fake_llms", "start_host", "sandbox_redis", "sandbox_root", "registry", "python_image",
    "llamacpp", "llamacpp_no_jinja", "llamacpp_installed", "smol_tokenizer", "served",
})
# the markers addopts deselects (setup.cfg); a unit test carries none of them
DESELECTED = frozenset({"slow", "chaos", "slurm", "real_llm", "trainer", "learning", "multinode", "apptainer", "swebench",
                        "harness", "harbor", "audit"})
ALLOWED_PROCESSES = ("tasks/verify/math_worker.py",)  # the math grader's capped worker


class NotInProcess(AssertionError):
    """A ``unit`` test started a process or connected somewhere other than the session's Redis."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        if item.get_closest_marker("unit") is None:
            continue
        heavy = sorted(HEAVY_FIXTURES.intersection(getattr(item, "fixturenames", ())))
        marked = sorted(m.name for m in item.iter_markers() if m.name in DESELECTED)
        if heavy or marked:
            wrong.append(f"{item.nodeid}: " + "; ".join(
                part for part in (heavy and f"uses {', '.join(heavy)}", marked and f"marked {', '.join(marked)}")
                if part))
    if wrong:
        raise pytest.UsageError("tests marked unit that are not in process (tests/unit_tier.py):\n  "
                                + "\n  ".join(wrong))


def _redis_addresses() -> set[tuple[str, int]]:
    """The session's Redis, and the LLM routing's own when it has one (PRORL_TEST_ROUTING_REDIS)."""
    from urllib.parse import urlsplit

    urls = [urlsplit(os.environ.get(name, "")) for name in ("PRORL_REDIS_URL", "PRORL_ROUTING_URL")]
    return {(url.hostname, url.port) for url in urls if url.hostname and url.port}


@pytest.fixture(autouse=True)
def _unit_stays_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """For a ``unit`` test: no process but the math grader's worker, no connection but Redis."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    redis_at, test_thread = _redis_addresses(), threading.get_ident()
    popen_init, connect, connect_ex, fork = (subprocess.Popen.__init__, socket.socket.connect,
                                             socket.socket.connect_ex, os.fork)

    def guarded_popen(self, args, *rest, **kwargs):
        words = [args] if isinstance(args, (str, bytes)) else [str(a) for a in args]
        if threading.get_ident() == test_thread and not any(
                allowed in word for word in words for allowed in ALLOWED_PROCESSES):
            raise NotInProcess(f"a unit test started a process: {args!r}")
        return popen_init(self, args, *rest, **kwargs)

    def check_address(sock: socket.socket, address) -> None:
        if (threading.get_ident() == test_thread and sock.family in (socket.AF_INET, socket.AF_INET6)
                and tuple(address[:2]) not in redis_at):
            raise NotInProcess(f"a unit test connected to {address!r} (only the session's Redis, "
                               f"{redis_at}, is allowed)")

    def guarded_connect(self, address):
        check_address(self, address)
        return connect(self, address)

    def guarded_connect_ex(self, address):
        check_address(self, address)
        return connect_ex(self, address)

    def guarded_fork():
        if threading.get_ident() == test_thread:
            raise NotInProcess("a unit test forked")
        return fork()

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", guarded_connect_ex)
    monkeypatch.setattr(os, "fork", guarded_fork)
    yield


@pytest.fixture
def scratch_redis(redis_url):
    """A database of the session's Redis that no worker or sweep reads, emptied: for a test that
    puts a job in a running stage by hand (holding no lease, which the stack's sweep, running in
    the default suite, would end after a few seconds)."""
    import redis

    client = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/12")
    client.flushdb()
    return client
