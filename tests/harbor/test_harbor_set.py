"""A public set of terminal-bench-style Harbor tasks (``harbor_set.json``) graded end to end here.

For each task: its image builds from its own Dockerfile, its own solution (the oracle) earns 1,
an agent that does nothing earns 0, and agents that forge the reward the usual ways earn 0: the
reward file written by the agent, ``/logs`` filled and locked before the verifier, the tests
rewritten, a ``conftest.py`` that turns every failure into a pass planted in the working directory
and its parents, a PATH shim for the test runners.

The tasks are not kept in this project: ``scripts/fetch-harbor-set.sh`` extracts them and prints
the directory to give as ``PRORL_HARBOR_SET``. Every job is submitted first (the oracles first,
so that each image is built by one job while the others queue behind it), then all are awaited;
the table of results is written to ``PRORL_HARBOR_SET_REPORT`` when set.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import submit
from tests.harbor.test_harbor_e2e import FORGERIES, NOOP, ORACLE, command

SET_DIR = os.environ.get("PRORL_HARBOR_SET")
WAIT_S = 2400.0  # everything submitted at once: first builds, then 7 jobs a task on 2 cores
UNSET = "PRORL_HARBOR_SET is unset: run scripts/fetch-harbor-set.sh and set it to the directory printed"
pytestmark = [pytest.mark.harbor, pytest.mark.timeout(int(WAIT_S) + 600), pytest.mark.skipif(not SET_DIR, reason=UNSET)]
SPEC = json.loads((Path(__file__).with_name("harbor_set.json")).read_text())
TASKS = SPEC["tasks"]

PASS_ALL = ("import pytest\\n@pytest.hookimpl(hookwrapper=True)\\ndef pytest_runtest_makereport(item, call):\\n"
            "    rep = (yield).get_result()\\n    rep.outcome = \"passed\"\\n    rep.longrepr = None\\n")
AGENTS = {
    "oracle": ORACLE,
    "no-op": NOOP,
    "reward file": command(FORGERIES["reward file"]),
    "logs prefilled": command(FORGERIES["logs prefilled"]),
    "tests edited": command("mkdir -p /tests && printf '#!/bin/bash\\nmkdir -p /logs/verifier\\n"
                            "echo 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh && chmod +x /tests/test.sh "
                            "&& for f in /tests/test_*.py; do printf 'def test_ok():\\n    pass\\n' > \"$f\"; done"),
    "conftest planted": command(f"d=$PWD; while :; do printf '{PASS_ALL}' > \"$d/conftest.py\"; "
                                "[ \"$d\" = / ] && break; d=$(dirname \"$d\"); done; mkdir -p /tests; "
                                f"printf '{PASS_ALL}' > /tests/conftest.py"),
    "PATH shim": command(FORGERIES["PATH shim"]),
}


def _await(api: str, job: str, deadline: float) -> dict:
    while True:
        resp = requests.get(f"{api}/jobs/{job}/wait", params={"timeout": 60}, timeout=90)
        if resp.status_code == 200:
            return resp.json()
        if time.monotonic() > deadline:
            return {"status": "not terminal", "result": {"error": resp.text[:500]}}


def _row(job: dict) -> dict:
    out = job.get("result") or {}
    harbor = out.get("harbor") or {}
    step = (harbor.get("steps") or [{}])[-1]
    image = harbor.get("image") or {}
    return {"status": job.get("status"), "reward": out.get("reward"), "error": out.get("error"),
            "build_s": image.get("build_s"), "image": image.get("key"), "tampered": harbor.get("tampered"),
            "output": str(step.get("output", ""))[-1500:]}


@pytest.fixture(scope="module")
def outcomes(api, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """task -> agent -> row (status, reward, error, build_s, tampered, the verifier's output)."""
    root, copies = Path(str(SET_DIR)), tmp_path_factory.mktemp("harbor-set")  # under an allowed task dir
    started = time.monotonic()
    jobs = {}
    for agent in AGENTS:  # agent-major: the oracles (one per image) reach the init queue first
        for task in TASKS:
            copy = copies / task["path"]
            if not copy.exists():
                shutil.copytree(root / task["path"], copy, symlinks=True)
            jobs[task["path"], agent] = submit(api, {"data_source": "harbor", "task_dir": str(copy),
                                                     "agent": AGENTS[agent]})
    deadline = time.monotonic() + WAIT_S
    table: dict[str, dict[str, dict]] = {}
    for (task, agent), job in jobs.items():
        table.setdefault(task, {})[agent] = _row(_await(api, job, deadline))
    report = {"wall_s": round(time.monotonic() - started, 1), "load": os.getloadavg(), "tasks": table}
    if os.environ.get("PRORL_HARBOR_SET_REPORT"):
        Path(os.environ["PRORL_HARBOR_SET_REPORT"]).write_text(json.dumps(report, indent=1))
    return table


def _why(row: dict) -> str:
    return f"{row['status']} {row['error']} {row['output']}"


@pytest.mark.parametrize("task", TASKS, ids=[t["path"] for t in TASKS])
def test_the_image_builds_and_the_tasks_own_solution_earns_1(outcomes, task):
    row = outcomes[task["path"]]["oracle"]
    if task.get("expected_fail"):
        assert row["reward"] != 1.0, f"expected to fail here ({task['expected_fail']}) but solved"
        pytest.xfail(task["expected_fail"])
    assert row["status"] == "completed" and row["reward"] == 1.0, _why(row)


@pytest.mark.parametrize("agent", [a for a in AGENTS if a != "oracle"])
@pytest.mark.parametrize("task", TASKS, ids=[t["path"] for t in TASKS])
def test_doing_nothing_or_forging_earns_0(outcomes, task, agent):
    row = outcomes[task["path"]][agent]
    assert row["status"] == "completed" and row["reward"] == 0.0, _why(row)
