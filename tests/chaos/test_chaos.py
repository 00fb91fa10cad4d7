"""The chaos suite (``pytest -m chaos``): 200 rollouts of mixed domains against the fake LLM while
a driver kills run workers at random, kills Redis once, kills a sandbox host once and an LLM
backend once. Afterwards every job has ended with a result, no sandbox is left after one sweep
period, and no job has two rewards."""
from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter

import psutil
import pytest
import redis
import requests

from prorl_celery.launcher import Stack, StackOptions
from prorl_celery.procs import free_port
from sandboxes.client import list_sandboxes, live_hosts
from tasks.fixtures import swe
from tasks.fixtures.tasks import MATH, STEM
from tests.conftest import TEST_ENV

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1200)]
ORACLE = ["--policy", "oracle:tasks.fixtures.oracle:reply", "--latency-model", "step_s=0.002,capacity=64"]
TERMINAL = {"completed", "failed", "cancelled", "timeout"}


def _instances(tmp_path, n: int) -> list[dict]:
    rng = random.Random(7)
    repos = swe.build_all(tmp_path / "repos")
    pool = [*({"data_source": "math", **t} for t in MATH), *({"data_source": "stem", **t} for t in STEM),
            *({"data_source": "humaneval", "task_id": f"HumanEval/{i}"} for i in (0, 2, 4, 7, 12, 15, 23, 28)),
            *repos, {"data_source": "shell", "commands": ["echo chaos", "sleep 1", "true"]}]
    return [dict(rng.choice(pool)) for _ in range(n)]


class Driver(threading.Thread):
    """Breaks things while the batch runs; records what it did."""

    def __init__(self, stack: Stack, backends: list[str]):
        super().__init__(daemon=True)
        self.stack, self.backends = stack, backends
        self.done = threading.Event()
        self.log: list[str] = []
        self.rng = random.Random(11)

    def kill(self, name: str) -> None:
        child = self.stack.children[name]
        child.signal(signal.SIGKILL)
        child.popen.wait()
        self.log.append(f"{time.strftime('%X')} killed {name}")

    def run(self) -> None:
        plan = ["run", "redis", "run", "host", "run", "llm", "run"]
        for step in plan:
            if self.done.wait(self.rng.uniform(2.0, 4.0)):
                return
            if step == "run":
                self.kill("worker-run")
            elif step == "redis":
                self.stack.restart_redis()
                self.log.append(f"{time.strftime('%X')} restarted redis (SIGKILL)")
            elif step == "host":
                self.kill("sandbox-host")
            elif step == "llm":
                self.kill("fake-llm-a")


@pytest.fixture(scope="module")
def chaos_stack(tmp_path_factory):
    options = StackOptions(state_dir=tmp_path_factory.mktemp("chaos"), persist=True,
                           concurrency={"init": 8, "run": 32, "eval": 8, "maint": 1},
                           env={**TEST_ENV, "PRORL_SANDBOX_CAPACITY": "128", "PRORL_LLM_CALL_TIMEOUT_S": "20"})
    stack = Stack(options)
    stack.start_redis(free_port())
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def test_chaos(chaos_stack, tmp_path):
    stack, api = chaos_stack, chaos_stack.api_url
    backends = [stack.start_fake_llm(name=name, extra_args=ORACLE) for name in ("fake-llm-a", "fake-llm-b")]
    for url in backends:
        assert requests.post(f"{api}/llm_servers", json={"address": url}, timeout=10).status_code == 201
    jobs = [{"instance": inst} for inst in _instances(tmp_path, 200)]
    ids = requests.post(f"{api}/jobs", json={"jobs": jobs}, timeout=60).json()["job_ids"]
    driver = Driver(stack, backends)
    driver.start()

    views: dict[str, dict] = {}
    started, deadline = time.monotonic(), time.monotonic() + 900
    for job_id in ids:
        while job_id not in views and time.monotonic() < deadline:
            try:
                resp = requests.get(f"{api}/jobs/{job_id}/wait", params={"timeout": 30}, timeout=60)
            except requests.RequestException as exc:
                print(f"{time.monotonic() - started:6.0f}s {job_id}: {type(exc).__name__}", flush=True)
                time.sleep(1)  # the API may be reconnecting to Redis
                continue
            if resp.status_code == 200:
                views[job_id] = resp.json()
            elif resp.status_code == 202:
                print(f"{time.monotonic() - started:6.0f}s still waiting for {job_id}: {resp.json()['status']}",
                      flush=True)
            else:  # the API answers 5xx while Redis restarts; a trainer's client retries
                print(f"{time.monotonic() - started:6.0f}s {job_id}: HTTP {resp.status_code} {resp.text[:200]}",
                      flush=True)
                time.sleep(1)
    driver.done.set()
    driver.join()

    statuses = Counter(v["status"] for v in views.values())
    lost = len(ids) - len(views)
    client = redis.Redis.from_url(stack.redis_url)
    entries = Counter(e[b"job_id"].decode() for _, e in client.xrange("prorl:completions"))
    duplicates = sum(1 for job_id in ids if entries[job_id] > 1)
    time.sleep(2 * float(TEST_ENV["PRORL_SWEEP_INTERVAL_S"]) + float(TEST_ENV["PRORL_STAGE_LEASE_S"]))
    leaked = sum(len(list_sandboxes(h.address, h.token)) for h in live_hosts(client))
    sleeping = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[:2] == ["sleep", "1"]]
    print("\nchaos driver:", "; ".join(driver.log))
    print(f"jobs={len(ids)} completed={statuses['completed']} failed={statuses['failed']} "
          f"cancelled={statuses['cancelled']} timeout={statuses['timeout']} lost={lost} "
          f"leaked_sandboxes={leaked} duplicates={duplicates}")
    assert lost == 0 and all(v["status"] in TERMINAL and v["result"] for v in views.values())
    assert duplicates == 0 and all(entries[job_id] == 1 for job_id in ids)
    assert leaked == 0 and not sleeping
    assert statuses["completed"] >= 150, statuses  # faults cost some rollouts, typed; most complete
    for view in views.values():
        if view["status"] != "completed":
            assert view["result"]["critical_error"] in {"init", "run", "eval", "sandbox", "llm", "timeout"}
