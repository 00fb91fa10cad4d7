"""The hack audit end to end on a stack of its own (Harbor's shared verifier allowed, as an
operator may): every policy of the library earns a reward from the grader deliberately weak
against it (tests/audit/weak) where a no-op agent earns 0, so no policy can rot into a no-op; the
same library earns nothing from our graders on the example tasks; ``prorl-celery audit`` stores
the verdict and the API then refuses the task until it changes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import requests

from prorl_celery.client import ProrlClient
from prorl_celery.ops.audit_cli import table
from tasks.audit import policies, taskset
from tasks.audit.runner import run_audit
from tests.audit.weak_tasks import assemble, graders
from tests.conftest import ROOT, own_stack

pytestmark = [pytest.mark.audit, pytest.mark.timeout(3600)]
EXAMPLES = ROOT / "examples" / "harbor"
WAIT = 2400.0  # a first run builds the Debian base and the images


@pytest.fixture(scope="module")
def audit_stack(tmp_path_factory):
    from sandboxes.runtimes.env.build import env_dir

    env = {"PRORL_HARBOR_SHARED_VERIFIER": "1", "PRORL_SANDBOX_IMAGE_DIRS": str(env_dir()), "PRORL_ENV_DIR": str(env_dir()),
           "PRORL_REPO_CACHE": str(tmp_path_factory.mktemp("repo-cache"))}  # and a SWE row's environment
    with own_stack(tmp_path_factory.mktemp("audit-stack"), concurrency={"init": 4, "run": 8, "eval": 4, "maint": 1},
                   env=env) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(audit_stack) -> ProrlClient:
    return ProrlClient(audit_stack.api_url, token=audit_stack.api_token)


@pytest.fixture(scope="module")
def weak_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("weak")
    for name in graders():
        assemble(root, name)
    return root


@pytest.fixture(scope="module")
def weak_verdicts(client, weak_root):
    """Each weak task audited with its own policy (all at once)."""
    lib = policies.library()

    def audit_one(name: str):
        return run_audit(client, taskset.load([str(weak_root / name)]), [lib[name]], timeout=WAIT)[0]

    with ThreadPoolExecutor(len(lib)) as pool:
        return dict(zip(lib, pool.map(audit_one, lib)))


@pytest.mark.parametrize("name", sorted(policies.library()))
def test_each_policy_beats_the_grader_weak_against_it(weak_verdicts, name):
    verdict = weak_verdicts[name]
    noop, run = verdict.evidence
    assert noop.reward == 0.0, noop.model_dump()
    assert verdict.hackable and verdict.policies == [name], json.dumps(run.model_dump(), indent=1)[-4000:]
    assert run.reward == 1.0 and run.wrote  # it says what it did


def test_our_graders_give_no_policy_a_reward_on_the_example_tasks(client):
    verdicts = run_audit(client, taskset.load([str(EXAMPLES)]), policies.select(None), timeout=WAIT)
    rows = [v.model_dump(mode="json") for v in verdicts]
    print(table(rows))
    assert [v.task for v in verdicts] == sorted(p.parent.name for p in EXAMPLES.glob("*/task.toml"))
    assert not [(v.task, v.policies) for v in verdicts if v.hackable], table(rows)


@pytest.fixture(scope="module")
def swe_row(tmp_path_factory) -> dict:
    """marshmallow-1359 (tests/fixtures/swebench), its repository at base_commit and its
    environment built (or found built) on this node."""
    from sandboxes.runtimes.env.build import ensure_env
    from tests.real import swebench_data
    from tests.real.test_swebench import recipe_of

    row = swebench_data.rows()["marshmallow-code__marshmallow-1359"]
    repo = swebench_data.materialize(row, tmp_path_factory.mktemp("swe") / "repo")
    return {**row, "repo_source": str(repo), "image": str(ensure_env(recipe_of(row["instance_id"], repo)))}


def test_our_swe_grader_gives_no_policy_a_reward_on_a_real_row(client, swe_row, tmp_path):
    """The row as a JSONL line without data_source."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(swe_row) + "\n")
    verdicts = run_audit(client, taskset.load([str(rows)]), policies.select(None), timeout=WAIT)
    table_text = table([v.model_dump(mode="json") for v in verdicts])
    print(table_text)
    (verdict,) = verdicts
    for e in verdict.evidence:  # what each did, and the SWE grader's integrity verdict on it
        integrity = (e.grader.get("eval") or {}).get("integrity") or {} if isinstance(e.grader.get("eval"), dict) else {}
        print(e.policy, e.reward, integrity.get("outcome"), e.wrote[:4])
    assert verdict.data_source == "swebench" and verdict.baseline == 0.0, table_text
    assert [e.status for e in verdict.evidence] == ["completed"] * len(verdict.evidence), verdict.model_dump_json()[-3000:]
    assert not verdict.hackable, verdict.model_dump_json()[-6000:]


def test_the_cli_stores_the_verdict_and_the_api_refuses_the_task_until_it_changes(audit_stack, weak_root):
    task = weak_root / "reward_file"
    env = {**os.environ, "PRORL_API_TOKEN": audit_stack.api_token, "PRORL_REDIS_URL": audit_stack.redis_url,
           "PRORL_API_URL": audit_stack.api_url}
    done = subprocess.run([sys.executable, "-m", "prorl_celery.ops.cli", "audit", str(task), "--policies",
                           "reward_file,path_shim"], env=env, capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 1, done.stdout + done.stderr  # a hackable task found
    assert "HACKABLE" in done.stdout and "reward_file" in done.stdout and "1 hackable" in done.stderr
    headers = {"Authorization": f"Bearer {audit_stack.api_token}"}
    instance = {"data_source": "harbor", "task_dir": str(task)}
    resp = requests.post(f"{audit_stack.api_url}/jobs", json={"instance": instance}, headers=headers, timeout=30)
    assert resp.status_code == 409, resp.text
    assert resp.json()["error"]["task"] == "reward_file" and resp.json()["error"]["policies"] == ["reward_file"]
    listed = requests.get(f"{audit_stack.api_url}/audit", headers=headers, timeout=30).json()["verdicts"]
    assert [(v["task"], v["hackable"], v["current"]) for v in listed] == [("reward_file", True, True)]
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 0 > /logs/verifier/reward.txt\n")  # "fixed"
    resp = requests.post(f"{audit_stack.api_url}/jobs", json={"instance": {**instance, "agent": policies.NOOP.agent()}},
                         headers=headers, timeout=30)
    assert resp.status_code == 202
    assert redis.Redis.from_url(audit_stack.redis_url).scard("prorl:audit:verdicts") == 1


def test_rescore_replays_a_kept_workspace_through_todays_grader(audit_stack, client, swe_row):
    """A rollout whose stored reward an older grader got wrong (simulated: its stored reward set to
    0) is replayed from its kept diff, and the change reported; the stored original stays as it was.
    A Harbor result beside it is replayed from its kept workspace (a no-op's: 0 then and now)."""
    from prorl_celery.jobs import JobStore
    from tasks.audit.rescore import rescore

    instance = {**swe_row, "data_source": "swebench"}
    gold = client.wait(client.submit({**instance, "agent": {"harness": "replay", "patch": swe_row["patch"]}}),
                       timeout=WAIT)
    assert gold["result"]["reward"] == 1.0, gold["result"].get("eval")
    store = JobStore(redis.Redis.from_url(audit_stack.redis_url))
    record = store.get(gold["job_id"])
    store.redis.hset(f"prorl:job:{gold['job_id']}", "result", json.dumps({**record.result, "reward": 0.0}))
    harbor = client.wait(client.submit({"data_source": "harbor", "task_dir": str(EXAMPLES / "hello"),
                                        "agent": policies.NOOP.agent()}), timeout=WAIT)
    swe, other = rescore(client, store, [gold["job_id"], harbor["job_id"]], timeout=WAIT)
    assert (swe.original, swe.today, swe.changed) == (0.0, 1.0, True), swe
    assert store.get(gold["job_id"]).result["reward"] == 0.0  # the stored original untouched
    assert (other.original, other.today, other.changed, other.how) == (0.0, 0.0, False, "harbor workspace, new job"), other
    assert other.replay_job and other.replay_job != harbor["job_id"]


def test_harbor_submit_audits_a_dataset_before_its_first_training_submission(audit_stack):
    env = {**os.environ, "PRORL_API_TOKEN": audit_stack.api_token, "PRORL_REDIS_URL": audit_stack.redis_url,
           "PRORL_API_URL": audit_stack.api_url}
    agent = json.dumps({"harness": "command", "command": "echo 'good morning' > /app/greeting.txt"})
    argv = [sys.executable, "-m", "prorl_celery.ops.cli", "harbor", "submit", str(EXAMPLES / "hello"), "--agent", agent,
            "--n", "1"]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=WAIT)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "auditing 1 task(s)" in first.stderr and "hello" in first.stderr and "ok" in first.stderr
    assert "1/1" in first.stdout  # solved: the table of the submission itself
    listed = ProrlClient(audit_stack.api_url, token=audit_stack.api_token).audit()["verdicts"]
    assert [(v["task"], v["hackable"]) for v in listed if v["task"] == "hello"] == [("hello", False)]
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=WAIT)
    assert again.returncode == 0 and "auditing" not in again.stderr, again.stderr
