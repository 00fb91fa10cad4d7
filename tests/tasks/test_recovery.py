"""Crash recovery on a stack of its own with a persistent Redis: Redis killed mid-batch loses no
job; every accepted job ends with a result."""
from __future__ import annotations

from collections import Counter

import pytest
import requests

from tests.conftest import own_stack, wait_until
from tests.helpers import dead


@pytest.fixture(scope="module")
def durable(tmp_path_factory):
    with own_stack(tmp_path_factory.mktemp("durable"), persist=True,
                   concurrency={"init": 4, "run": 8, "eval": 4, "maint": 1}) as stack:
        yield stack


def test_redis_killed_mid_batch_loses_no_job(durable):
    api = durable.api_url
    jobs = [{"instance": {"data_source": "shell", "commands": ["sleep 1.5", "echo done"],
                          "sandbox": {"runtime": "local"}}} for _ in range(40)]
    ids = requests.post(f"{api}/jobs", json={"jobs": jobs}, timeout=30).json()["job_ids"]
    wait_until(lambda: requests.get(f"{api}/status", timeout=10).json()["running"] >= 4, 30, "a running batch")
    durable.restart_redis()  # SIGKILL: no chance to save anything on the way down
    statuses = Counter()
    for job_id in ids:
        resp = requests.get(f"{api}/jobs/{job_id}/wait", params={"timeout": 120}, timeout=150)
        assert resp.status_code == 200, (job_id, resp.status_code, resp.text[:300])
        view = resp.json()
        statuses[view["status"]] += 1
        assert view["result"]["job_id"] == job_id
    assert sum(statuses.values()) == 40
    assert statuses["completed"] >= 36, statuses  # a stage cut by the outage may end typed
    assert requests.get(f"{api}/healthz", timeout=10).json()["ok"]


def test_watchdog_revives_a_stalled_consumer(stack, api):
    """A worker that stops taking messages from its queue (what celery#8030 does after a broker
    reconnect) gets its consumer re-added, and the waiting job completes."""
    from prorl_celery.celery_app import app as celery_app
    from tests.conftest import submit, wait

    eval_workers = requests.get(f"{api}/healthz", timeout=10).json()["worker_names"]["eval"]
    celery_app.control.cancel_consumer("eval", destination=eval_workers, reply=True)
    job_id = submit(api, {"data_source": "shell", "commands": ["true"], "sandbox": {"runtime": "local"}})
    view = wait(api, job_id, timeout=30)
    assert view["status"] == "completed"
    assert "re-adding it" in stack.children["worker-eval"].log_path.read_text()


def test_sandbox_host_killed_mid_run(stack, api):
    """kill -9 of the sandbox host: its sandboxes die with it, the job runs again from init on
    the restarted host (tests/tasks/test_retries.py has the whole story), and that host serves the
    next job."""
    import signal as sig

    import psutil

    from prorl_celery.connections import get_store
    from sandboxes.base import SandboxHandle
    from sandboxes.client import RemoteSandbox
    from tests.conftest import submit, wait

    job_id = submit(api, {"data_source": "shell", "commands": ["echo up", "sleep 60", "echo never"]})
    wait_until(lambda: len((get_store().get(job_id).state or {}).get("steps", [])) == 1, 30, "the first step")
    pid = RemoteSandbox(SandboxHandle.model_validate(get_store().get(job_id).sandbox)).info()["pid"]
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    host = stack.children["sandbox-host"]
    host.signal(sig.SIGKILL)
    host.popen.wait()
    wait_until(lambda: (r := get_store().get(job_id)).attempt == 2 and len(r.state.get("steps", [])) == 1,
               60, "the second attempt's first step")
    view = requests.delete(f"{api}/jobs/{job_id}", timeout=30).json()
    assert [a["fault"] for a in view["result"]["attempts"]][0] in {"sandbox_gone", "sandbox_host_unreachable"}
    wait_until(lambda: all(dead(p) for p in tree), 10,
               "the sandbox's processes to die with their host")
    after = submit(api, {"data_source": "shell", "commands": ["echo again"]})
    assert wait(api, after, timeout=60)["status"] == "completed"
