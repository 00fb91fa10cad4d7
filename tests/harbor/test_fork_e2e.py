"""Init once, fork n, on the real stack: a group of Harbor samples prepares its step once
(``setup.sh`` run in one sandbox, its root frozen into a layer) and every sample starts from it
copy-on-write: each sees what setup made (files and a deletion, not its process), none sees a
sibling's writes, and the layer is removed once the group ended."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import ROOT
from tests.harbor.test_harbor_e2e import BUILD_WAIT

pytestmark = pytest.mark.harbor

TOML = """schema_version = "1.1"
artifacts = ["/srv/tool/stamp", "/srv/tool/seen.txt"]

[task]
name = "prorl/forked"

[environment]
workdir = "/srv/tool"

[[steps]]
name = "main"

[steps.healthcheck]
command = "test -s /srv/tool/stamp"
interval_sec = 0.2
timeout_sec = 5
retries = 2
"""
SETUP = """set -e
head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n' > stamp
echo prepared > state.txt
mkdir -p repo && for i in $(seq 1 200); do echo "line $i" > repo/f$i.txt; done
rm -f /etc/debian_version
(sleep 1000 </dev/null >/dev/null 2>&1 &)
"""
TEST = """#!/bin/bash
if [ "$(sed -n '1p;3p' /srv/tool/seen.txt)" = "$(printf 'prepared\\nrepo=200')" ] \\
   && [ "$(grep -c '^mine ' /srv/tool/state.txt)" = 1 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
# each sample: what it found, then its own write over the prepared file, held while the others write theirs
AGENT = {"harness": "command", "command": (
    "cd /srv/tool && cat state.txt > seen.txt && "
    "echo sleepers=$(cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | grep -c '^1000$') >> seen.txt && "
    "echo repo=$(ls repo | wc -l) >> seen.txt && (test -e /etc/debian_version && echo deletion-lost >> seen.txt; "
    "true) && echo \"mine $$ $RANDOM\" > state.txt && sleep 2 && cat state.txt >> seen.txt")}


@pytest.fixture
def task(tmp_path: Path) -> Path:
    root = tmp_path / "forked"
    shutil.copytree(ROOT / "examples" / "harbor" / "stages" / "environment", root / "environment")
    step = root / "steps" / "main"
    (step / "workdir").mkdir(parents=True)
    (step / "tests").mkdir()
    (root / "task.toml").write_text(TOML)
    (step / "instruction.md").write_text("Leave your mark on state.txt.\n")
    (step / "workdir" / "setup.sh").write_text(SETUP)
    (step / "tests" / "test.sh").write_text(TEST)
    return root


def group(api: str, task: Path, n: int, **extra) -> list[dict]:
    instance = {"data_source": "harbor", "task_dir": str(task), "agent": AGENT, **extra}
    resp = requests.post(f"{api}/groups", json={"instance": instance, "n": n}, timeout=30)
    assert resp.status_code in (200, 201, 202), resp.text
    jobs, deadline = resp.json()["job_ids"], time.monotonic() + BUILD_WAIT
    done = []
    for job in jobs:
        while True:
            resp = requests.get(f"{api}/jobs/{job}/wait", params={"timeout": 60}, timeout=90)
            if resp.status_code == 200:
                done.append(resp.json())
                break
            assert time.monotonic() < deadline, resp.text[:2000]
    return done


def node_layers(redis_client) -> list[str]:
    from sandboxes.client import list_layers, live_hosts

    return [layer.name for host in live_hosts(redis_client) for layer in list_layers(host.address, host.token)]


def test_a_group_prepares_once_and_each_sample_forks_from_it(api, task, redis_client):
    jobs = group(api, task, 3)
    results = [job["result"] for job in jobs]
    assert [job["status"] for job in jobs] == ["completed"] * 3, [r.get("error") for r in results]
    seen = [r["harbor"]["steps"][0]["artifacts"]["srv/tool/seen.txt"]["text"] for r in results]
    assert [r["reward"] for r in results] == [1.0] * 3, seen  # each saw setup's files, not a sibling's write
    assert all(text.splitlines()[1] == "sleepers=0" for text in seen), seen  # setup's process stayed behind
    forks = [r["harbor"]["fork"] for r in results]
    preparers = [job["job_id"] for job, f in zip(jobs, forks) if f["from"] == "self"]
    assert len(preparers) == 1, forks
    assert all(f["from"] in ("self", preparers[0]) for f in forks) and len({f["layer"] for f in forks}) == 1
    assert forks[0]["bytes"] > 0 and all(f["waited_s"] >= 0 for f in forks)
    stamps = {r["harbor"]["steps"][0]["artifacts"]["srv/tool/stamp"]["text"] for r in results}
    assert len(stamps) == 1  # setup.sh ran once for the group
    layer, deadline = forks[0]["layer"], time.monotonic() + 60
    while layer in node_layers(redis_client):  # removed by the sweep once the group ended
        assert time.monotonic() < deadline, f"layer {layer} outlived its group"
        time.sleep(1)


def test_forking_turned_off_prepares_each_sample_and_says_why(api, task):
    jobs = group(api, task, 2, fork=False)
    results = [job["result"] for job in jobs]
    assert [r["reward"] for r in results] == [1.0, 1.0], results
    assert [r["harbor"]["fork"] for r in results] == [{"off": "off (instance.fork)"}] * 2
    seen = [r["harbor"]["steps"][0]["artifacts"]["srv/tool/seen.txt"]["text"] for r in results]
    assert all(text.splitlines()[1] == "sleepers=1" for text in seen), seen  # setup's own sandbox: still running
    stamps = {r["harbor"]["steps"][0]["artifacts"]["srv/tool/stamp"]["text"] for r in results}
    assert len(stamps) == 2  # each ran setup.sh itself
