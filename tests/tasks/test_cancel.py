"""Cancel at every point of a rollout: the job ends `cancelled` with its partial result, the
sandbox's whole process tree is gone, and an in-flight LLM request is aborted (the fake server
sees the client go away). ``POST /cancel_all`` of many running rollouts (on a stack of its own,
whose run worker holds them all): every one a typed result, no sandbox process left."""
from __future__ import annotations

import secrets
import time

import psutil
import pytest
import redis
import requests

from prorl_celery.connections import get_store
from prorl_celery.jobs import JobStore
from prorl_celery.models import JobResult
from sandboxes.base import SandboxHandle
from sandboxes.client import RemoteSandbox, list_sandboxes
from prorl_celery.fakes.problems import MATH
from tests.conftest import own_stack, submit, wait, wait_until
from tests.helpers import dead

BULK = 30  # rollouts running at once for cancel_all

SLOW = ["--policy", "oracle:prorl_celery.fakes.oracle:reply", "--latency-model", "step_s=0.5,capacity=4"]


def _status(api: str, job_id: str) -> str:
    return requests.get(f"{api}/jobs/{job_id}", timeout=10).json()["status"]


def _sandbox_tree(job_id: str, store: JobStore | None = None) -> list[psutil.Process]:
    record = (store or get_store()).get(job_id)
    pid = RemoteSandbox(SandboxHandle.model_validate(record.sandbox)).info()["pid"]
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _gone(procs: list[psutil.Process]) -> bool:
    return all(dead(p) for p in procs)


def _cancel(api: str, job_id: str) -> dict:
    resp = requests.delete(f"{api}/jobs/{job_id}", timeout=30)
    assert resp.status_code == 200, resp.text
    view = wait(api, job_id, timeout=10)
    assert view["status"] == "cancelled" and view["result"]["critical_error"] == "cancelled"
    return view


@pytest.fixture(scope="module")
def slow_llm(stack, api):
    requests.post(f"{api}/clear_llm_server", timeout=10)
    url = stack.start_fake_llm(name="fake-slow", extra_args=SLOW)
    assert requests.post(f"{api}/llm_servers", json={"address": url}, timeout=10).status_code == 201
    yield url
    requests.post(f"{api}/clear_llm_server", timeout=10)


def test_cancel_while_waiting_for_the_llm_aborts_the_request(api, slow_llm):
    requests.post(f"{slow_llm}/debug/reset", timeout=10)
    job_id = submit(api, {"data_source": "math", "problem": MATH[2]["problem"], "answer": "2"})

    def in_flight():
        reqs = requests.get(f"{slow_llm}/debug/requests", timeout=10).json()["requests"]
        return [r for r in reqs if r["status"] == "running"]
    wait_until(in_flight, 30, "the LLM request to be in flight")
    tree = _sandbox_tree(job_id)
    started = time.monotonic()
    view = _cancel(api, job_id)
    assert view["result"]["turns"] == 0 and view["result"]["stage"] == "run"
    wait_until(lambda: not in_flight(), 5, "the fake server to see the client go away")
    stats = requests.get(f"{slow_llm}/debug/stats", timeout=10).json()
    assert stats["aborted"] >= 1
    wait_until(lambda: _gone(tree), 5, "the sandbox's processes to die")
    assert time.monotonic() - started < 6


def test_cancel_during_init(api):
    job_id = submit(api, {"data_source": "tests.handlers_for_tests:SlowInitHandler", "commands": ["true"]})
    wait_until(lambda: _status(api, job_id) == "init" and get_store().get(job_id).sandbox, 30, "init")
    time.sleep(0.3)  # inside the slow command
    tree = _sandbox_tree(job_id)
    view = _cancel(api, job_id)
    assert view["result"]["stage"] == "init"
    wait_until(lambda: _gone(tree), 5, "the sandbox's processes to die")


def test_cancel_during_eval(api):
    job_id = submit(api, {"data_source": "tests.handlers_for_tests:SlowEvalHandler", "commands": ["echo ran"]})
    wait_until(lambda: _status(api, job_id) == "eval", 30, "eval")
    time.sleep(0.3)
    tree = _sandbox_tree(job_id)
    view = _cancel(api, job_id)
    assert view["result"]["stage"] == "eval" and view["result"]["steps"][0]["output"] == "ran\n"
    wait_until(lambda: _gone(tree), 5, "the sandbox's processes to die")


def test_cancel_while_a_command_runs(api):
    job_id = submit(api, {"data_source": "shell", "commands": ["echo first", "sleep 60"]})
    wait_until(lambda: len((get_store().get(job_id).state or {}).get("steps", [])) == 1, 30, "the first step")
    time.sleep(0.3)
    tree = _sandbox_tree(job_id)
    assert any("sleep" in " ".join(p.cmdline()) for p in tree if p.is_running())
    view = _cancel(api, job_id)
    assert [s["output"] for s in view["result"]["steps"]] == ["first\n"]
    wait_until(lambda: _gone(tree), 5, "the sandbox's processes to die")


def test_a_cancelled_rollouts_stage_ends_its_chain_with_a_note(api):
    """The run stage a cancel ends returns a note as its result (no Ignore, whose traceback
    copy cost 1.8 ms each) and sends no eval: the chain stops at the stage that saw the end."""
    from celery.result import AsyncResult

    from prorl_celery.celery_app import app

    job_id = submit(api, {"data_source": "shell", "commands": ["sleep 60"]})
    wait_until(lambda: get_store().get(job_id).status.value == "run" and get_store().get(job_id).sandbox,
               30, "the run stage")
    time.sleep(0.5)
    _cancel(api, job_id)
    run = AsyncResult(f"{job_id}:run", app=app)
    wait_until(lambda: run.state == "SUCCESS", 15, "the run stage's note")
    assert run.result["skipped"].startswith("the job ended") and run.result["job_id"] == job_id
    time.sleep(1.0)  # an eval sent by the chain would have stored its own note by now
    assert AsyncResult(f"{job_id}:eval", app=app).state == "PENDING"


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A stack of its own (own Redis) whose run worker holds BULK rollouts at once."""
    with own_stack(tmp_path_factory.mktemp("wide"), persist=False,
                   concurrency={"init": 8, "run": BULK + 4, "eval": 2, "maint": 1},
                   env={"PRORL_SANDBOX_CAPACITY": str(BULK + 10)}) as stack:
        yield stack


def _sleeping(marker: list[str]) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == marker]


def test_cancel_all_of_running_rollouts_leaves_typed_results_and_no_sandbox(wide):
    api, store = wide.api_url, JobStore(redis.Redis.from_url(wide.redis_url))
    marker = ["sleep", f"900.{secrets.randbelow(10**6):06d}"]  # this test's sleeps, nobody else's
    jobs = [{"instance": {"data_source": "shell", "commands": [" ".join(marker)]}} for _ in range(BULK)]
    ids = requests.post(f"{api}/jobs", json={"jobs": jobs}, timeout=60).json()["job_ids"]
    wait_until(lambda: len(_sleeping(marker)) == BULK, 180, f"{BULK} sandboxes inside their sleep")
    trees = {job_id: _sandbox_tree(job_id, store) for job_id in ids}
    sleepers = set(_sleeping(marker))
    assert all(sleepers & set(tree) for tree in trees.values())  # each sandbox runs its own
    resp = requests.post(f"{api}/cancel_all", json={}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert sorted(resp.json()["job_ids"]) == sorted(ids)
    for job_id in ids:
        result = JobResult.model_validate(store.get(job_id).result)
        assert (result.status.value, result.critical_error, result.stage) == ("cancelled", "cancelled", "run")
    every = [p for tree in trees.values() for p in tree]
    wait_until(lambda: _gone(every), 30, "every sandbox process to die")
    assert not _sleeping(marker)
    handle = store.get(ids[0]).sandbox
    assert list_sandboxes(handle["address"], handle["token"]) == []  # closed before cancel_all answered
