"""The quarantine in process: verdicts by content hash in the session's Redis, the submission
check under each operator policy (``create_app()`` and Flask's test client; the chain's submit is
replaced, so nothing reaches the stack's workers), what lifts it, and ``GET /audit``."""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from prorl_celery import keys
from tasks.audit import policies, quarantine

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
TOKEN = {"Authorization": f"Bearer {os.environ['PRORL_API_TOKEN']}"}


@pytest.fixture
def task(tmp_path) -> dict:
    folder = Path(shutil.copytree(ROOT / "examples" / "harbor" / "hello", tmp_path / "hello"))
    (folder / "NOTE").write_text(uuid.uuid4().hex)  # its own content hash, not the example's
    return {"data_source": "harbor", "task_dir": str(folder)}


@pytest.fixture
def verdict(redis_client, task):
    """A hackable verdict for ``task``, removed afterwards (the session's Redis is the stack's)."""
    found = {"task": "hello", "data_source": "harbor", "hackable": True, "policies": ["reward_file"],
             "content_hash": quarantine.content_hash(task), "grader_version": quarantine.grader_version("harbor"),
             "baseline": 0.0, "audited_at": 1.0}
    quarantine.store(redis_client, found)
    yield found
    redis_client.delete(keys.audit_verdict(found["content_hash"]))
    redis_client.srem(keys.audit_verdicts(), found["content_hash"])


@pytest.fixture
def client(redis_url, monkeypatch):
    from flask_api import create_app, groups, jobs

    fake_submit = lambda store, requests, project=None: [r.job_id or uuid.uuid4().hex for r in requests]  # noqa: E731
    monkeypatch.setattr(jobs, "submit", fake_submit)
    monkeypatch.setattr(groups, "submit", fake_submit)
    return create_app({"TESTING": True}).test_client()


@pytest.fixture
def audit_policy(monkeypatch):
    from config.settings import get_settings

    def set_to(value: str) -> None:
        monkeypatch.setenv("PRORL_AUDIT_POLICY", value)
        get_settings.cache_clear()
    yield set_to
    monkeypatch.delenv("PRORL_AUDIT_POLICY", raising=False)
    get_settings.cache_clear()


def _post(client, instance, group=False):
    if group:
        return client.post("/groups", json={"instance": instance, "n": 2}, headers=TOKEN)
    return client.post("/jobs", json={"instance": instance}, headers=TOKEN)


def test_the_content_hash_follows_the_files_and_the_grading_fields(task):
    first = quarantine.content_hash(task)
    assert quarantine.content_hash({**task, "agent": {"harness": "oracle"}, "trajectory_id": 3}) == first
    (Path(task["task_dir"]) / "tests" / "test.sh").write_text("#!/bin/bash\necho 0 > /logs/verifier/reward.txt\n")
    assert quarantine.content_hash(task) != first
    row = {"data_source": "swebench", "repo": "o/r", "base_commit": "a" * 40, "test_patch": "p",
           "problem_statement": "x"}
    assert quarantine.content_hash({**row, "problem_statement": "y"}) == quarantine.content_hash(row)
    assert quarantine.content_hash({**row, "test_patch": "q"}) != quarantine.content_hash(row)


def test_refuse_names_the_task_and_the_policy(client, task, verdict, audit_policy):
    audit_policy("refuse")
    for group in (False, True):
        resp = _post(client, task, group)
        assert resp.status_code == 409, resp.json
        error = resp.json["error"]
        assert error["type"] == "task_quarantined" and error["task"] == "hello"
        assert error["policies"] == ["reward_file"] and error["field"] == "instance"
    batch = client.post("/jobs", json={"jobs": [{"instance": {"data_source": "echo", "text": "hi"}},
                                                {"instance": task}]}, headers=TOKEN)
    assert batch.status_code == 409


def test_warn_accepts_with_a_warning_and_allow_says_nothing(client, task, verdict, audit_policy):
    audit_policy("warn")
    resp = _post(client, task)
    assert resp.status_code == 202 and resp.json["warnings"][0]["task"] == "hello"
    assert resp.json["warnings"][0]["policies"] == ["reward_file"]
    assert _post(client, task, group=True).json["warnings"][0]["type"] == "task_quarantined"
    audit_policy("allow")
    resp = _post(client, task)
    assert resp.status_code == 202 and "warnings" not in resp.json


def test_the_audits_own_agents_run_a_quarantined_task(client, task, verdict, audit_policy):
    audit_policy("refuse")
    for policy in (policies.NOOP, policies.library()["reward_file"]):
        assert _post(client, {**task, "agent": policy.agent()}).status_code == 202
    assert _post(client, {**task, "agent": {"harness": "command", "command": "echo hi"}}).status_code == 409


def test_a_changed_task_or_grader_lifts_the_quarantine(client, task, verdict, audit_policy, monkeypatch):
    audit_policy("refuse")
    assert _post(client, task).status_code == 409
    import tasks.harbor.verifier as harbor_verifier

    current = harbor_verifier.GRADER_VERSION
    monkeypatch.setattr(harbor_verifier, "GRADER_VERSION", "2-test")
    assert _post(client, task).status_code == 202
    monkeypatch.setattr(harbor_verifier, "GRADER_VERSION", current)
    assert _post(client, task).status_code == 409
    (Path(task["task_dir"]) / "tests" / "test.sh").write_text("#!/bin/bash\necho 0 > /logs/verifier/reward.txt\n")
    assert _post(client, task).status_code == 202


def test_get_audit_lists_the_verdicts_behind_the_token(client, verdict):
    assert client.get("/audit").status_code == 401
    body = client.get("/audit", headers=TOKEN).json
    mine = [v for v in body["verdicts"] if v["content_hash"] == verdict["content_hash"]]
    assert mine and mine[0]["hackable"] and mine[0]["current"] and mine[0]["policies"] == ["reward_file"]
    assert body["policy"] in quarantine.POLICIES


def test_the_operators_verdict_quarantines_with_its_reason_and_lifts(client, task, redis_client, redis_url,
                                                                     audit_policy, monkeypatch, capsys):
    """``prorl-celery quarantine``: a hack found by hand (no policy earns) refuses the task, GET
    /audit says why, ``--lift`` lets it run again; a reason is required."""
    from prorl_celery.ops import cli

    audit_policy("refuse")
    monkeypatch.setenv("PRORL_REDIS_URL", redis_url)
    assert _post(client, task).status_code == 202
    with pytest.raises(SystemExit):
        cli.main(["quarantine", task["task_dir"]])
    assert cli.main(["quarantine", task["task_dir"], "--reason", "items.json written by hand passes"]) == 0
    try:
        resp = _post(client, task)
        assert resp.status_code == 409 and resp.json["error"]["policies"] == ["operator"]
        listed = [v for v in client.get("/audit", headers=TOKEN).json["verdicts"]
                  if v["content_hash"] == quarantine.content_hash(task)]
        assert listed[0]["reason"] == "items.json written by hand passes" and listed[0]["current"]
        assert cli.main(["quarantine", task["task_dir"], "--lift"]) == 0
        assert _post(client, task).status_code == 202
        assert "lifted" in capsys.readouterr().out
    finally:
        quarantine.lift(redis_client, task)
