"""The chaos suite (``pytest -m chaos``): 1,000 rollouts of mixed domains against two oracle fake
LLMs and two sandbox hosts, while a driver keeps breaking things until the batch is done: the run
worker SIGKILLed again and again, Redis SIGKILLed and restarted, a sandbox host SIGKILLed (each
in turn), an LLM backend SIGKILLed (the stack's supervisor restarts what dies). Infrastructure
faults cost a retry from init, not a sample (tasks/retry.py).

Afterwards every job has ended with a result, at least 98 % completed, no job has two completion
entries, after one sweep period no live host lists a sandbox, and once the hosts are stopped
no sandbox is left: no process naming a host's workspace directory, no mount under one, no
member in a sandbox cgroup (before that, each host's warm sandboxes are alive by design).

Size and length by environment (a shorter variant while developing):
``PRORL_CHAOS_JOBS`` (1000), ``PRORL_CHAOS_GAP_S`` (seconds between faults, "6,12"),
``PRORL_CHAOS_MIN_COMPLETED`` (fraction, 0.98), ``PRORL_CHAOS_DEADLINE_S`` (1800).
"""
from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import redis
import requests

from prorl_celery.ops.launcher import Stack, StackOptions
from prorl_celery.ops.procs import free_port
from sandboxes.runtimes.limits import cgroups
from sandboxes.client import list_sandboxes, live_hosts
from sandboxes.host.reap import mounts_under, processes_naming
from prorl_celery.fakes import swe
from prorl_celery.fakes.problems import MATH, STEM
from tests.conftest import TEST_ENV

JOBS = int(os.environ.get("PRORL_CHAOS_JOBS", "1000"))
GAP_S = tuple(float(x) for x in os.environ.get("PRORL_CHAOS_GAP_S", "6,12").split(","))
MIN_COMPLETED = float(os.environ.get("PRORL_CHAOS_MIN_COMPLETED", "0.98"))
DEADLINE_S = float(os.environ.get("PRORL_CHAOS_DEADLINE_S", "1800"))
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(int(DEADLINE_S) + 600)]
ORACLE = ["--policy", "oracle:prorl_celery.fakes.oracle:reply", "--latency-model", "step_s=0.002,capacity=64"]
TERMINAL = {"completed", "failed", "cancelled", "timeout"}
HOSTS = ("sandbox-host", "sandbox-host-2")


def _instances(tmp_path, n: int) -> list[dict]:
    rng = random.Random(7)
    repos = swe.build_all(tmp_path / "repos")
    pool = [*({"data_source": "math", **t} for t in MATH), *({"data_source": "stem", **t} for t in STEM),
            *({"data_source": "humaneval", "task_id": f"HumanEval/{i}"} for i in (0, 2, 4, 7, 12, 15, 23, 28)),
            *repos, {"data_source": "shell", "commands": ["echo chaos", "sleep 1", "true"]}]
    return [dict(rng.choice(pool)) for _ in range(n)]


class Driver(threading.Thread):
    """Breaks things, round after round, until told to stop; records what it did."""

    PLAN = ("run", "llm", "run", "host", "run", "redis")

    def __init__(self, stack: Stack):
        super().__init__(daemon=True)
        self.stack = stack
        self.done = threading.Event()
        self.log: list[str] = []
        self.counts: Counter = Counter()
        self.rng = random.Random(11)

    def kill(self, name: str) -> None:
        child = self.stack.children[name]
        child.signal(signal.SIGKILL)
        child.popen.wait()
        self.counts[name] += 1
        self.log.append(f"{time.strftime('%X')} killed {name}")

    def step(self, what: str) -> None:
        if what == "run":
            self.kill("worker-run")
        elif what == "redis":
            self.stack.restart_redis()
            self.counts["redis"] += 1
            self.log.append(f"{time.strftime('%X')} restarted redis (SIGKILL)")
        elif what == "host":
            self.kill(HOSTS[self.counts["hosts"] % 2])
            self.counts["hosts"] += 1
        elif what == "llm":
            self.kill("fake-llm-a")

    def run(self) -> None:
        while True:
            for what in self.PLAN:
                if self.done.wait(self.rng.uniform(*GAP_S)):
                    return
                try:
                    self.step(what)
                except Exception as exc:  # noqa: BLE001 - a fault that could not be made is logged
                    self.log.append(f"{time.strftime('%X')} {what} failed: {exc}")


@pytest.fixture(scope="module")
def chaos_stack(tmp_path_factory):
    options = StackOptions(state_dir=tmp_path_factory.mktemp("chaos"), persist=True,
                           concurrency={"init": 8, "run": 32, "eval": 8, "maint": 1},
                           env={**TEST_ENV, "PRORL_SANDBOX_CAPACITY": "128", "PRORL_LLM_CALL_TIMEOUT_S": "20"})
    stack = Stack(options)
    stack.start_redis(free_port())
    try:
        stack.start()
        stack.start_sandbox_host(HOSTS[1])
        yield stack
    finally:
        stack.stop()


def _wait_all(api: str, ids: list[str]) -> dict[str, dict]:
    views: dict[str, dict] = {}
    started, deadline = time.monotonic(), time.monotonic() + DEADLINE_S
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
            elif resp.status_code != 202:  # 5xx while Redis restarts; a trainer's client retries
                print(f"{time.monotonic() - started:6.0f}s {job_id}: HTTP {resp.status_code} {resp.text[:200]}",
                      flush=True)
                time.sleep(1)
        if len(views) % 100 == 0 and job_id in views:
            print(f"{time.monotonic() - started:6.0f}s {len(views)} of {len(ids)} ended", flush=True)
    return views


def _leftovers(stack: Stack, client: redis.Redis, host_ids: list[str]) -> dict[str, int]:
    """What is left of sandboxes, counted by what they own, not by name: listed by a live host
    (after the sweep), then, once the hosts are stopped, anything of any sandbox."""
    from config.settings import get_settings

    root = Path(get_settings().sandbox_root or os.path.join(tempfile.gettempdir(), "prorl-sandboxes"))
    listed = sum(len(list_sandboxes(h.address, h.token)) for h in live_hosts(client))
    for name in HOSTS:
        stack.pause_supervision(name)
        stack.children[name].stop()
    procs = sum(len(processes_naming(root / host_id)) for host_id in host_ids)
    mounts = sum(len(mounts_under(root / host_id)) for host_id in host_ids)
    members = 0
    for host_id in host_ids:
        base = cgroups.V1_ROOT / "pids" / cgroups.PREFIX / cgroups.host_key(str(root / host_id))
        for directory in base.glob("*/") if base.is_dir() else []:
            members += len((directory / "cgroup.procs").read_text().split())
    return {"listed": listed, "processes": procs, "mounts": mounts, "cgroup_members": members}


def test_chaos(chaos_stack, tmp_path):
    stack, api = chaos_stack, chaos_stack.api_url
    backends = [stack.start_fake_llm(name=name, extra_args=ORACLE) for name in ("fake-llm-a", "fake-llm-b")]
    for url in backends:
        assert requests.post(f"{api}/llm_servers", json={"address": url}, timeout=10).status_code == 201
    jobs = [{"instance": inst} for inst in _instances(tmp_path, JOBS)]
    started = time.monotonic()
    ids = []
    for i in range(0, len(jobs), 500):
        ids += requests.post(f"{api}/jobs", json={"jobs": jobs[i:i + 500]}, timeout=120).json()["job_ids"]
    driver = Driver(stack)
    driver.start()
    views = _wait_all(api, ids)
    wall = time.monotonic() - started
    driver.done.set()
    driver.join()

    statuses = Counter(v["status"] for v in views.values())
    lost = len(ids) - len(views)
    client = redis.Redis.from_url(stack.redis_url)
    entries = Counter(e[b"job_id"].decode() for _, e in client.xrange("prorl:completions"))
    duplicates = sum(1 for job_id in ids if entries[job_id] > 1)
    retried = sum(1 for v in views.values() if len((v["result"] or {}).get("attempts") or []) > 1)
    faults = Counter(a["fault"] for v in views.values() for a in (v["result"] or {}).get("attempts", [])
                     if a["fault"])
    time.sleep(2 * float(TEST_ENV["PRORL_SWEEP_INTERVAL_S"]) + float(TEST_ENV["PRORL_STAGE_LEASE_S"]))
    host_ids = sorted({v["result"]["attempts"][-1]["host"] for v in views.values()
                       if (v["result"] or {}).get("attempts") and v["result"]["attempts"][-1]["host"]}
                      | {a["host"] for v in views.values() for a in (v["result"] or {}).get("attempts", [])
                         if a["host"]})
    left = _leftovers(stack, client, host_ids)
    leaked = left["listed"] + left["processes"] + left["mounts"] + left["cgroup_members"]
    sleeping = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[:2] == ["sleep", "1"]]
    print("\nchaos driver:", dict(driver.counts), "; ".join(driver.log[-12:]))
    print("faults retried or final:", dict(faults), "leftovers:", left)
    print(f"jobs={len(ids)} completed={statuses['completed']} failed={statuses['failed']} "
          f"cancelled={statuses['cancelled']} timeout={statuses['timeout']} retried={retried} "
          f"lost={lost} leaked_sandboxes={leaked} duplicates={duplicates} wall_s={wall:.0f}")
    assert lost == 0 and all(v["status"] in TERMINAL and v["result"] for v in views.values())
    assert duplicates == 0 and all(entries[job_id] == 1 for job_id in ids)
    assert leaked == 0 and not sleeping, left
    assert statuses["completed"] >= MIN_COMPLETED * len(ids), statuses
    for view in views.values():
        if view["status"] != "completed":
            assert view["result"]["critical_error"] in {"init", "run", "eval", "sandbox", "llm", "timeout"}
