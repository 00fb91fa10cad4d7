"""Flower shows every stage task with a readable name, the job id and the data source: read through
its API and seen on its task pages in a real headless Chromium."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import requests

from prorl_celery.ops.procs import Child, free_port, wait_for
from tests.conftest import submit, wait

AUTH = ("ops", "flower-pass")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def flower(stack, tmp_path_factory):
    port = free_port()
    child = Child("flower", [sys.executable, "-m", "celery", "-A", "prorl_celery", "flower", f"--port={port}",
                             "--address=127.0.0.1", f"--basic-auth={AUTH[0]}:{AUTH[1]}"],
                  stack.env(), tmp_path_factory.mktemp("flower")).start()
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _workers(url) >= 4, 60, "Flower to see the workers", child=child, pause=0.5)
    yield url
    child.stop()


def _workers(url: str) -> int:
    try:
        resp = requests.get(f"{url}/api/workers", params={"refresh": "true"}, auth=AUTH, timeout=10)
    except requests.RequestException:
        return 0
    return len(resp.json()) if resp.status_code == 200 else 0


def _dom(url: str) -> str:
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", "--virtual-time-budget=8000", "--dump-dom", url],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_flower_api_shows_each_stage_with_job_and_data_source(api, flower):
    job_id = submit(api, {"data_source": "shell", "commands": ["echo flower"], "sandbox": {"runtime": "local"}})
    assert wait(api, job_id)["status"] == "completed"
    for stage in ("init", "run", "eval"):
        info = wait_for(lambda: _task(flower, f"{job_id}:{stage}"), 30, f"Flower to record {stage}")
        assert info["name"] == f"prorl.{stage}" and info["state"] == "SUCCESS"
        assert job_id in info["args"] and "shell" in info["kwargs"]
        assert info["worker"].startswith(f"{stage}@")
    assert requests.get(f"{flower}/api/workers", timeout=10).status_code == 401  # the API needs the password


def _task(flower: str, task_id: str) -> dict | None:
    resp = requests.get(f"{flower}/api/task/info/{task_id}", auth=AUTH, timeout=10)
    return resp.json() if resp.status_code == 200 and resp.json().get("state") == "SUCCESS" else None


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (scripts/install-system-deps.sh installs it)")
def test_flower_pages_in_headless_chromium(api, flower):
    job_id = submit(api, {"data_source": "shell", "commands": ["true"], "sandbox": {"runtime": "local"}})
    wait(api, job_id)
    wait_for(lambda: _task(flower, f"{job_id}:eval"), 30, "Flower to record the job")
    base = flower.replace("http://", f"http://{AUTH[0]}:{AUTH[1]}@")
    page = _dom(f"{base}/task/{job_id}:run")
    assert job_id in page and "prorl.run" in page and "shell" in page and "SUCCESS" in page
    # the listing as the browser renders it (its first page: the beat's sweep, once a second in the
    # tests, can push the job past it) and the job in it by the search that page's box sends
    listing = _dom(f"{base}/tasks")
    assert "tasks-table" in listing and "prorl." in listing and "SUCCESS" in listing, listing[-3000:]
    found = requests.get(f"{flower}/tasks/datatable", auth=AUTH, timeout=10, params={
        "draw": 1, "start": 0, "length": 15, "search[value]": job_id, "order[0][column]": 0,
        "columns[0][data]": "name", "order[0][dir]": "asc"}).json()
    assert {row["uuid"] for row in found["data"]} == {f"{job_id}:{stage}" for stage in ("init", "run", "eval")}, found
