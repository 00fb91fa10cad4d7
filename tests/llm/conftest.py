"""Fake LLM servers as real subprocesses on free ports, and a pool on the session's private Redis."""
from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import requests

from prorl_celery.ops.procs import Child, free_port, wait_for
from tests.conftest import wait_until


class FakeLLMProc:
    """One ``prorl-celery fake-llm`` process and its debug endpoints."""

    def __init__(self, child: Child, url: str):
        self.child, self.url = child, url

    def received(self, since: int = 0) -> list[dict]:
        return requests.get(f"{self.url}/debug/requests", params={"since": since}, timeout=5).json()["requests"]

    def stats(self) -> dict:
        return requests.get(f"{self.url}/debug/stats", timeout=5).json()

    def faults(self, **faults) -> dict:
        return requests.post(f"{self.url}/debug/faults", json=faults, timeout=5).json()

    def up(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False


@pytest.fixture
def fake_llms(tmp_path: Path):
    """``start(n, latency=..., policy=..., extra=[...])`` -> n fake servers, stopped after the test."""
    started: list[FakeLLMProc] = []
    env = dict(os.environ)

    def start(n: int = 1, latency: str = "none", policy: str = "echo", extra: list[str] | None = None,
              speeds: list[float] | None = None) -> list[FakeLLMProc]:
        procs = []
        for i in range(n):
            port = free_port()
            argv = [sys.executable, "-m", "prorl_celery.fakes.llm.server", "--port", str(port),
                    "--latency-model", latency, "--policy", policy, *(extra or [])]
            if speeds:
                argv += ["--speed", str(speeds[i])]
            child = Child(f"fake-llm-{port}", argv, env, tmp_path).start()
            procs.append(FakeLLMProc(child, f"http://127.0.0.1:{port}"))
        for proc in procs:
            wait_for(proc.up, 20, f"fake LLM at {proc.url}", child=proc.child)
        started.extend(procs)
        return procs

    yield start
    for proc in started:  # all told at once: each takes most of a second to exit, and a test starts several
        proc.child.signal(signal.SIGTERM)
    for proc in started:
        proc.child.stop(grace_s=2)


@pytest.fixture
def redis_conn(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def pool(redis_conn, monkeypatch):
    """An LLMPool on an empty registry, with short backoffs and probe periods."""
    from config.settings import get_settings
    from prorl_celery.llm import LLMPool

    settings = get_settings()
    for name, value in {"llm_backoff_s": 0.05, "llm_probe_period_s": 0.3, "llm_retry_budget": 3,
                        "llm_no_backend_wait_s": 20.0}.items():
        monkeypatch.setattr(settings, name, value)
    llm_pool = LLMPool(redis_conn)
    llm_pool.router.flush_counts()  # a test's counters are not written onto the next one's backends
    llm_pool.registry.clear()
    yield llm_pool
    llm_pool.router.flush_counts()
    llm_pool.registry.clear()


def add(pool, proc_or_url, **spec) -> str:
    from prorl_celery.llm import BackendSpec

    url = proc_or_url if isinstance(proc_or_url, str) else proc_or_url.url
    if spec.get("protocol") == "generate":
        spec.setdefault("dialect", "fake")  # the fake server's test-only token API
    backend, _ = pool.registry.add(BackendSpec(address=url, **spec))
    return backend.id


@contextmanager
def project_jobs(pool, owners, prefix: str = "route", per: int = 0):
    """Jobs of each owner (a project's name, or None: the operator's), stored so the router reads
    their project: ``{owner: job id}``, or ``{owner: [job ids]}`` with ``per`` > 0; all cancelled
    on the way out."""
    from prorl_celery.jobs import JobStore
    from prorl_celery.models import JobRequest
    from prorl_celery.status import JobStatus

    store, tag = JobStore(pool.redis), uuid.uuid4().hex[:8]
    ids = {owner: [f"{prefix}-{owner or 'op'}-{tag}-{i}" for i in range(per or 1)] for owner in owners}
    for owner, of_owner in ids.items():
        store.create_many([(job_id, JobRequest(instance={"data_source": "shell"})) for job_id in of_owner],
                          project=owner)
    try:
        yield ids if per else {owner: of_owner[0] for owner, of_owner in ids.items()}
    finally:
        for of_owner in ids.values():
            for job_id in of_owner:
                store.transition(job_id, JobStatus.CANCELLED)


def weighted_projects(pool, prefix: str, **weights: float) -> dict[str, str]:
    """Projects of these weights, named uniquely: ``{given name: project name}``."""
    from prorl_celery.projects import ProjectStore

    tag, projects = uuid.uuid4().hex[:8], ProjectStore(pool.redis)
    names = {given: f"{prefix}{given}-{tag}" for given in weights}
    for given, weight in weights.items():
        projects.add(names[given], weight=weight)
    return names


def eventually(predicate, timeout: float = 10.0, what: str = "condition"):
    return wait_until(predicate, timeout, what)


TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object",
                                                          "properties": {"cmd": {"type": "string"}}}}}]
SCRIPT = [{"content": "Let me look.", "tool_calls": [{"name": "bash", "arguments": {"cmd": "ls"}}]},
          {"content": "", "tool_calls": [{"name": "bash", "arguments": {"cmd": "cat a.txt"}}]},
          {"content": "Done: the answer is 42."}]


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "script.json"
    path.write_text(json.dumps(SCRIPT))
    return path


FIRST = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Find it ✓"}]


def tool_rollout(pool, rollout_id: str, turns: int = 3, **request) -> tuple[list, list[dict]]:
    """``turns`` generated turns of one rollout, each answered by a tool message ``out <k>``;
    returns the turns and the whole conversation."""
    from prorl_celery.llm import LLMRequest

    messages, done, previous = list(FIRST), [], None
    for k in range(turns):
        turn = pool.generate(rollout_id, LLMRequest(messages=messages, tools=TOOLS, previous=previous, **request))
        done.append(turn)
        messages = messages + [turn.message, {"role": "tool", "tool_call_id": "x", "content": f"out {k}\n"}]
        previous = turn
    return done, messages
