"""Harbor task folders end to end on the real stack: images built from their Dockerfiles on a
Debian root, the agent in a writable image-rooted sandbox, the verifier in a fresh one.

The oracle (the task's own solve.sh) earns the full reward, an agent that does nothing earns 0,
and agents that try the field's reward forgeries earn 0 too: a reward file written by the agent,
``/logs`` filled before the verifier, tests planted where the verifier would read them, a
``conftest.py`` planted beside the code, a PATH shim for ``pytest``/``uvx``, a process left
behind to rewrite the reward after the test wrote it.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import requests

from tasks.harbor.verifier import GRADER_VERSION
from tests.conftest import ROOT, submit

pytestmark = pytest.mark.harbor
EXAMPLES = ROOT / "examples" / "harbor"
BUILD_WAIT = 900.0  # a first run builds the Debian base and the images; later runs find them built


def run(api: str, task: str | Path, agent: dict | None, timeout: float = BUILD_WAIT) -> dict:
    instance = {"data_source": "harbor", "task_dir": str(task if isinstance(task, Path) else EXAMPLES / task)}
    if agent is not None:
        instance["agent"] = agent
    job, deadline = submit(api, instance), time.monotonic() + timeout
    while True:  # the API's long poll is at most 600 s at a time
        resp = requests.get(f"{api}/jobs/{job}/wait", params={"timeout": 60}, timeout=90)
        if resp.status_code == 200:
            return resp.json()
        assert time.monotonic() < deadline, f"job {job} not terminal after {timeout}s: {resp.text[:2000]}"


def command(script: str) -> dict:
    return {"harness": "command", "command": script}


ORACLE = {"harness": "oracle"}
NOOP = command("true")


def result(job: dict) -> dict:
    assert job["status"] == "completed", job.get("result")
    return job["result"]


def test_the_oracle_solves_and_a_noop_agent_does_not(api):
    solved = result(run(api, "hello", ORACLE))
    assert solved["reward"] == 1.0 and solved["resolved"] is True
    harbor = solved["harbor"]
    assert harbor["steps"][0]["mode"] == "separate" and harbor["rewards"] == {"reward": 1.0}
    assert "debian" in harbor["image"]["base"] and "ubuntu:24.04" in harbor["image"]["base"]
    assert harbor["network"]["agent"] is False  # the operator has not allowed the internet
    assert harbor["grader_version"] == GRADER_VERSION  # what the audit stamps its verdicts with
    assert result(run(api, "hello", NOOP))["reward"] == 0.0


def test_named_rewards_reach_the_trainer_and_the_headline_is_their_mean(api):
    out = result(run(api, "scores", ORACLE))
    assert out["harbor"]["rewards"] == {"correctness": 1.0, "style": 1.0} and out["reward"] == 1.0
    half = result(run(api, "scores", command("printf 'import sys\\nprint(42)\\n\\n\\n\\n' > /work/sum.py")))
    assert half["harbor"]["rewards"] == {"correctness": 1.0, "style": 0.0} and half["reward"] == 0.5


def test_steps_run_in_order_with_their_files_and_stop_below_min_reward(api):
    out = result(run(api, "stages", ORACLE))
    steps = out["harbor"]["steps"]
    assert [s["name"] for s in steps] == ["make", "extend"] and [s["reward"] for s in steps] == [1.0, 1.0]
    assert out["reward"] == 1.0 and "count.sh" in str(steps[-1]["artifacts"])
    stopped = result(run(api, "stages", NOOP))
    assert len(stopped["harbor"]["steps"]) == 1 and "min_reward" in stopped["harbor"]["steps"][0]["stopped"]
    assert stopped["reward"] == 0.0


FORGERIES = {
    "reward file": "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt",
    "logs prefilled": "mkdir -p /logs/verifier && echo '{\"reward\": 1}' > /logs/verifier/reward.json "
                      "&& chmod -R a-w /logs",
    "tests planted": "mkdir -p /tests && printf '#!/bin/bash\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh",
    "conftest planted": "printf 'import pytest\\n@pytest.hookimpl(tryfirst=True)\\ndef pytest_runtest_call(item):\\n"
                        "    return True\\ndef pytest_collection_modifyitems(items):\\n    items.clear()\\n' "
                        "| tee /app/conftest.py /conftest.py /tests-conftest.py > /dev/null",
    "PATH shim": "for t in pytest uvx uv curl; do printf '#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\nexit 0\\n' "
                 "> /usr/local/bin/$t; chmod +x /usr/local/bin/$t; done; mkdir -p /root/.local/bin; "
                 "cp /usr/local/bin/uvx /root/.local/bin/uvx",
    "rewriter left running": "printf '#!/bin/sh\\nwhile :; do echo 1 > /logs/verifier/reward.txt 2>/dev/null; done\\n' "
                             "> /app/wordcount.py.sh; printf 'import subprocess\\nsubprocess.Popen([\"sh\", "
                             "\"/app/wordcount.py.sh\"], start_new_session=True)\\n"
                             "def top_words(path, k):\\n    return []\\n' > /app/wordcount.py",
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_forging_agent_earns_nothing(api, name):
    out = result(run(api, "wordcount", command(FORGERIES[name])))
    assert out["reward"] == 0.0, (name, out["harbor"]["steps"][0].get("output", "")[-2000:])
    if name == "rewriter left running":  # caught: the reward was rewritten after the test ended
        assert out["harbor"]["tampered"] == ["main"] and "after test.sh ended" in out["harbor"]["steps"][0]["tampered"]


def test_the_uvx_graded_task_grades_here_offline_but_for_the_registries(api):
    out = result(run(api, "wordcount", ORACLE))
    assert out["reward"] == 1.0, json.dumps({k: v for k, v in out["harbor"]["steps"][0].items() if k != "artifacts"})


def test_a_verifier_that_runs_past_its_timeout_is_a_fault_not_a_zero(api, tmp_path):
    task = Path(shutil.copytree(EXAMPLES / "hello", tmp_path / "slow"))
    text = (task / "task.toml").read_text().replace("timeout_sec = 60.0", "timeout_sec = 3.0")
    (task / "task.toml").write_text(text)
    (task / "tests" / "test.sh").write_text("#!/bin/bash\nsleep 30\necho 1 > /logs/verifier/reward.txt\n")
    job = run(api, task, ORACLE)
    assert job["status"] == "failed" and job["result"]["error"]["type"] == "verifier_timeout"
    assert job["result"]["critical_error"] == "run"  # each step is graded in the stage that ran its agent


def test_bad_tasks_and_agent_blocks_are_refused_at_submission_naming_the_field(api, tmp_path):
    task = Path(shutil.copytree(EXAMPLES / "hello", tmp_path / "gpu"))
    (task / "task.toml").write_text((task / "task.toml").read_text() + "gpus = 1\n")
    resp = requests.post(f"{api}/jobs", json={"instance": {"data_source": "harbor", "task_dir": str(task)}}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "task.toml.environment.gpus"
    resp = requests.post(f"{api}/jobs", json={"instance": {"data_source": "harbor", "task_dir": "/etc"}}, timeout=30)
    assert resp.status_code == 403 and resp.json()["error"]["field"] == "instance.task_dir"
    resp = requests.post(f"{api}/jobs", json={"instance": {"data_source": "shell", "commands": ["true"],
                                                           "agent": ORACLE}}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "instance.agent"
