"""Sizing and backpressure through ``prorl-celery up`` as an operator starts it.

One real stack (its own Redis, a sandbox host of capacity 2, a worker per queue, beat, the API)
started by ``up --concurrency``: the threads asked for reach the workers and ``/healthz`` shows
them; five rollouts on a host that holds two all complete, the ones that had to wait for a
sandbox say so in ``timings.init_wait``, none fails.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import requests

from prorl_celery.ops import sizing
from prorl_celery.statedir import read_secrets
from tests.conftest import ROOT, TEST_ENV, wait_until


@pytest.mark.unit
def test_concurrency_flags_parse_and_name_bad_parts():
    assert sizing.parse_concurrency("run=1050, init=64") == {"run": 1050, "init": 64}
    for bad in ("walk=3", "run=0", "run", "run=x"):
        with pytest.raises(sizing.SizingError, match=bad.split("=")[0]):
            sizing.parse_concurrency(bad)


@pytest.mark.unit
def test_plan_follows_the_settings_in_order():
    settings = sizing.settings_with({"PRORL_SANDBOX_CAPACITY": "1100"})
    assert sizing.plan(settings).concurrency == {"init": 64, "run": 1100, "eval": 64, "maint": 2}
    settings = sizing.settings_with({"PRORL_SANDBOX_CAPACITY": "1100", "PRORL_WORKER_CONCURRENCY": "7",
                                     "PRORL_QUEUE_CONCURRENCY": '{"eval": 3}'})
    planned = sizing.plan(settings, {"run": 1050})
    assert planned.concurrency == {"init": 7, "run": 1050, "eval": 3, "maint": 2}
    assert planned.source == {"init": "worker_concurrency", "run": "--concurrency",
                              "eval": "queue_concurrency", "maint": "sandbox_capacity=1100"}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """``prorl-celery up --concurrency ...`` on a host of capacity 2; yields (api, token)."""
    state = tmp_path_factory.mktemp("up-sized")
    env = {**os.environ, **TEST_ENV, "PRORL_SANDBOX_CAPACITY": "2", "PRORL_SANDBOX_WARM": "0"}
    for name in ("PRORL_REDIS_URL", "PRORL_API_TOKEN"):  # its own Redis and token, as `up` makes
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "prorl_celery.ops.cli", "up", "--port", "0", "--dev",
                             "--no-fake-llm", "--state-dir", str(state),
                             "--concurrency", "run=5,init=5", "--concurrency", "eval=3"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "ready":
                break
        api = next(line.split()[1] for line in lines if line.startswith("api "))
        yield api, read_secrets(str(state))["PRORL_API_TOKEN"], "".join(lines)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def test_up_concurrency_reaches_the_workers_and_healthz_shows_it(up):
    api, token, output = up
    assert "run=5 (--concurrency)" in output and "eval=3 (--concurrency)" in output, output
    assert "maint=2 (sandbox_capacity=2)" in output, output
    body = requests.get(f"{api}/healthz", timeout=30).json()
    assert body["threads"] == {"init": 5, "run": 5, "eval": 3, "maint": 2}, body
    assert all(len(held) == 1 for held in body["worker_threads"].values()), body


def test_a_full_host_makes_init_wait_not_fail(up):
    """Two jobs fill the host (capacity 2); three more submitted while they run wait in init for a
    sandbox (counted in ``init_wait``) and complete: none fails for want of one."""
    api, token, _ = up
    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {token}"

    def jobs(command: str, n: int) -> list[str]:
        job = {"instance": {"data_source": "shell", "commands": [command], "sandbox": {"runtime": "local"}}}
        return http.post(f"{api}/jobs", json={"jobs": [job] * n}, timeout=30).json()["job_ids"]

    holders = jobs("sleep 5", 2)
    wait_until(lambda: all(http.get(f"{api}/jobs/{i}", timeout=10).json()["status"] == "run" for i in holders),
               60, "both sandboxes in use")
    waiting = jobs("true", 3)
    views = [http.get(f"{api}/jobs/{i}/wait", params={"timeout": 90}, timeout=100).json() for i in holders + waiting]
    assert [v["status"] for v in views] == ["completed"] * 5, [v.get("result") for v in views]
    waits = [v["result"]["timing"]["init_wait"] for v in views[2:]]
    # submitted with the host full: each waited for a holder's sandbox (the holders had seconds left)
    assert all(w > 0.2 for w in waits), waits  # a free sandbox is taken in milliseconds
    assert all(v["timings"]["init_wait"] == v["result"]["timing"]["init_wait"] for v in views)
