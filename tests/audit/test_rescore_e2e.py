"""``prorl-celery rescore`` end to end on a stack of its own, one test per domain family: a Harbor
task (examples/harbor/hello, copied) whose result keeps its workspace diff, replayed by a new job
after the task's test changed; an answer domain (echo, a scripted fake LLM) whose stored answer is
re-graded by a changed handler. Each shows the changed reward reported and the stored original's
bytes the same before and after."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import redis

from prorl_celery.client import ProrlClient
from prorl_celery.jobs import JobStore
from prorl_celery.keys import job as job_key
from prorl_celery.keys import regrade_workspace
from tests.conftest import ROOT, own_stack

pytestmark = [pytest.mark.audit, pytest.mark.timeout(3600)]
WAIT = 2400.0  # a first run builds the Debian base and the image


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    script = tmp_path_factory.mktemp("script") / "turns.json"
    script.write_text(json.dumps([{"content": "Sure: 48213."}]))
    with own_stack(tmp_path_factory.mktemp("rescore-stack"), concurrency={"init": 2, "run": 4, "eval": 2, "maint": 1},
                   env={"PRORL_RESCORE_RETENTION_S": "3600", "PRORL_HARBOR_SHARED_VERIFIER": "1"}) as stack:
        url = stack.start_fake_llm(name="fake-rescore", extra_args=["--policy", f"scripted:{script}"])
        client = ProrlClient(stack.api_url, token=stack.api_token)
        client.add_llm_server(url, protocol="generate", dialect="fake")
        yield stack, client


def _stored(r: redis.Redis, job_id: str) -> dict:
    return r.hgetall(job_key(job_id))


def test_a_harbor_result_is_replayed_from_its_kept_workspace_after_its_test_changed(service, tmp_path):
    stack, client = service
    r = redis.Redis.from_url(stack.redis_url)
    task = tmp_path / "hello"
    shutil.copytree(ROOT / "examples" / "harbor" / "hello", task)
    agent = {"harness": "command", "command": "echo 'good morning' > /app/greeting.txt && echo scratch > /app/notes.txt"}
    done = client.wait(client.submit({"data_source": "harbor", "task_dir": str(task), "agent": agent}), timeout=WAIT)
    assert done["status"] == "completed" and done["result"]["reward"] == 1.0, done["result"].get("error")
    job_id = done["job_id"]
    [step] = done["result"]["harbor"]["steps"]
    assert step["kept"]["workspace"] is True and step["kept"]["files"] >= 2, step["kept"]
    assert 0 < r.ttl(regrade_workspace(job_id)) <= 3600  # PRORL_RESCORE_RETENTION_S
    before = _stored(r, job_id)

    env = {**os.environ, "PRORL_API_URL": stack.api_url, "PRORL_API_TOKEN": stack.api_token,
           "PRORL_REDIS_URL": stack.redis_url}
    argv = [sys.executable, "-m", "prorl_celery.ops.cli", "rescore", job_id, "--json", "--timeout", str(WAIT)]
    same = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=WAIT)
    assert same.returncode == 0, same.stdout + same.stderr  # the restored workspace earns its 1 again
    [row] = json.loads(same.stdout)
    assert (row["original"], row["today"], row["changed"], row["how"]) == (1.0, 1.0, False, "harbor workspace, new job")

    test = task / "tests" / "test.sh"
    test.write_text(test.read_text().replace("good morning", "good evening"))  # the task's test changed
    changed = subprocess.run(argv[:-3] + ["--timeout", str(WAIT)], env=env, capture_output=True, text=True,
                             timeout=WAIT)
    assert changed.returncode == 1, changed.stdout + changed.stderr
    assert "CHANGED" in changed.stdout and "1.000" in changed.stdout and "0.000" in changed.stdout, changed.stdout
    [again] = json.loads(subprocess.run(argv, env=env, capture_output=True, text=True, timeout=WAIT).stdout)
    replay = client.get(again["replay_job"])["result"]
    assert replay["reward"] == 0.0 and replay["harbor"]["steps"][0]["mode"] == "separate"  # the verifier as usual
    assert _stored(r, job_id) == before  # the stored original: the same bytes


def test_each_step_of_a_multi_step_task_is_restored_in_turn_and_a_shared_verifier_s_workspace_kept(service, tmp_path):
    """examples/harbor/stages (two steps, a healthcheck between them that needs step 1's executable,
    a setup.sh of step 2): each step's workspace restored by the replay on its own step; once step
    2's test wants another count, the mean drops to 0.5. hello graded in the agent's own sandbox
    (the operator allows the shared mode here) keeps its workspace too."""
    from tasks.audit.rescore import rescore

    stack, client = service
    r = redis.Redis.from_url(stack.redis_url)
    store = JobStore(r)
    stages = tmp_path / "stages"
    shutil.copytree(ROOT / "examples" / "harbor" / "stages", stages)
    both = ("if [ -f items.txt ]; then printf '#!/bin/sh\\nwc -l < /srv/tool/items.txt\\n' > count.sh; "
            "else printf '#!/bin/sh\\necho 0\\n' > count.sh; fi; chmod +x count.sh")
    shared = tmp_path / "hello-shared"
    shutil.copytree(ROOT / "examples" / "harbor" / "hello", shared)
    (shared / "task.toml").write_text((shared / "task.toml").read_text().replace(
        "[verifier]\n", "[verifier]\nenvironment_mode = \"shared\"\n"))
    ids = [client.submit({"data_source": "harbor", "task_dir": str(stages), "agent": {"harness": "command", "command": both}}),
           client.submit({"data_source": "harbor", "task_dir": str(shared),
                          "agent": {"harness": "command", "command": "echo 'good morning' > /app/greeting.txt"}})]
    done = [client.wait(j, timeout=WAIT) for j in ids]
    assert [d["result"]["reward"] for d in done] == [1.0, 1.0], [d["result"].get("harbor") for d in done]
    assert [s["kept"]["workspace"] for s in done[0]["result"]["harbor"]["steps"]] == [True, True]
    assert done[1]["result"]["harbor"]["steps"][0]["mode"] == "shared"
    before = [_stored(r, j) for j in ids]
    again = rescore(client, store, ids, timeout=WAIT)
    assert [(x.today, x.changed) for x in again] == [(1.0, False), (1.0, False)], again
    test = stages / "steps" / "extend" / "tests" / "test.sh"
    test.write_text(test.read_text().replace('= "$WANT"', '= "4"'))
    [row] = rescore(client, store, ids[:1], timeout=WAIT)
    assert (row.original, row.today, row.changed) == (1.0, 0.5, True), row
    assert [_stored(r, j) for j in ids] == before


def test_an_answer_is_regraded_by_a_changed_handler_and_the_change_reported(service, monkeypatch):
    from tasks.audit.rescore import rescore
    from tasks.handlers import echo

    stack, client = service
    r = redis.Redis.from_url(stack.redis_url)
    done = client.wait(client.submit({"data_source": "echo", "text": "48213", "match": "contains"},
                                     sampling_params={"max_turns": 1, "max_tokens": 32}), timeout=120)
    assert done["status"] == "completed" and done["result"]["reward"] == 1.0, done["result"]
    before = _stored(r, done["job_id"])
    store = JobStore(r)
    [same] = rescore(client, store, [done["job_id"]])
    assert (same.today, same.changed, same.how, same.replay_job) == (1.0, False, "answer, in process", None)
    monkeypatch.setattr(echo, "mentions", lambda text, value: text == value)  # today's grader: exact only
    [row] = rescore(client, store, [done["job_id"]])
    assert (row.original, row.today, row.changed) == (1.0, 0.0, True)
    assert _stored(r, done["job_id"]) == before


def test_a_code_answer_is_replayed_as_a_job_because_its_grader_runs_tests(service):
    """code's grader runs the tests in a sandbox: the stored answer goes to a new job whose replay
    agent holds it. The stored reward an older grader got wrong is simulated (set to 0, as the SWE
    e2e does); today's 1 is reported, the record's bytes the same before and after."""
    from tasks.audit.rescore import rescore

    stack, client = service
    r = redis.Redis.from_url(stack.redis_url)
    answer = "def add(a, b):\n    return a + b\n"
    instance = {"data_source": "code", "prompt": "Write add(a, b).", "tests": "assert add(1, 2) == 3",
                "agent": {"harness": "replay", "final_text": "Here it is.", "answer": answer}}
    done = client.wait(client.submit(instance), timeout=300)
    assert done["status"] == "completed" and done["result"]["reward"] == 1.0, done["result"]
    store = JobStore(r)
    record = store.get(done["job_id"])
    r.hset(job_key(done["job_id"]), "result", json.dumps({**record.result, "reward": 0.0}))
    before = _stored(r, done["job_id"])
    [row] = rescore(client, store, [done["job_id"]], timeout=300)
    assert (row.original, row.today, row.changed, row.how) == (0.0, 1.0, True, "answer, new job"), row
    assert _stored(r, done["job_id"]) == before
