"""The service end to end: API over HTTP, chains on real queues, real workers, a real sandbox host."""
from __future__ import annotations

import signal
import uuid

import psutil
import pytest
import requests

from prorl_celery.celery_app import app as celery_app
from tests.conftest import submit, wait, wait_until
from tests.flask_api.test_app import BAD_BODIES

LOCAL = {"runtime": "local"}


def shell(*commands: str, **extra) -> dict:
    return {"data_source": "shell", "commands": list(commands), "sandbox": LOCAL, **extra}


def test_health_reports_a_worker_per_queue(api):
    body = requests.get(f"{api}/healthz", timeout=10).json()
    assert body["ok"] and body["broker"] == "ok" and body["backend"] == "ok"
    assert {q: body["workers"][q] >= 1 for q in ("init", "run", "eval", "maint")} == \
        {"init": True, "run": True, "eval": True, "maint": True}


def test_batch_of_20_completes(api):
    jobs = [{"instance": shell(f"echo job-{i}", "cd /", "pwd"), "group_id": "batch20"} for i in range(19)]
    jobs.append({"instance": shell("true", "false"), "group_id": "batch20"})
    resp = requests.post(f"{api}/jobs", json={"jobs": jobs}, timeout=30)
    assert resp.status_code == 202
    ids = resp.json()["job_ids"]
    assert len(set(ids)) == 20
    views = [wait(api, job_id) for job_id in ids]
    assert all(view["status"] == "completed" for view in views)
    for i, view in enumerate(views[:19]):
        steps = view["result"]["steps"]
        assert [s["output"] for s in steps] == [f"job-{i}\n", "", "/\n"]  # cwd persisted across commands
        assert view["result"]["reward"] == 1.0 and view["result"]["resolved"] is True
    last = views[19]["result"]
    assert [s["exit_code"] for s in last["steps"]] == [0, 1] and last["reward"] == 0.0
    for view in views:
        timings = view["timings"]
        assert timings["total"] >= timings["init"] + timings["run"] + timings["eval"] > 0
        assert timings["queue"] >= 0


def test_the_api_subscribes_to_no_result_channel_for_the_chains_it_sends(api, redis_url):
    """The API reads the job store, never a task's result: sending a chain costs no SUBSCRIBE
    (and no later UNSUBSCRIBE) on the result backend, however many jobs a batch holds."""
    import redis

    client = redis.Redis.from_url(redis_url)

    def subscribes() -> int:
        return int(client.info("commandstats").get("cmdstat_subscribe", {}).get("calls", 0))

    before = subscribes()
    reply = requests.post(f"{api}/jobs", json={"jobs": [{"instance": shell("true")} for _ in range(20)]},
                          timeout=30)
    assert reply.status_code == 202, reply.text
    for job_id in reply.json()["job_ids"]:
        assert wait(api, job_id)["status"] == "completed"
    assert subscribes() - before == 0


def test_each_stage_runs_on_a_worker_of_its_queue(api, redis_url):
    job_id = submit(api, shell("echo hi"))
    view = wait(api, job_id)
    assert view["status"] == "completed"
    consumers = requests.get(f"{api}/healthz", timeout=10).json()["worker_names"]
    for stage in ("init", "run", "eval"):
        meta = celery_app.backend.get_task_meta(f"{job_id}:{stage}")
        assert meta["status"] == "SUCCESS", meta
        assert meta["queue"] == stage
        assert meta["worker"] in consumers[stage], (stage, meta["worker"], consumers)
        assert all(meta["worker"] not in consumers[q] for q in consumers if q != stage)
        assert view["workers"][stage] == meta["worker"]
    # the final result is in the result backend too, the same as in the job record
    assert celery_app.backend.get_task_meta(f"{job_id}:eval")["result"] == view["result"]


def test_resubmitting_a_job_id_runs_it_once(api, tmp_path):
    marker = tmp_path / "runs.txt"
    job_id = f"once-{uuid.uuid4().hex[:8]}"
    instance = shell(f"echo ran >> {marker}")
    assert submit(api, instance, job_id=job_id) == job_id
    first = wait(api, job_id)
    assert submit(api, instance, job_id=job_id) == job_id
    batch = requests.post(f"{api}/jobs", json={"jobs": [{"instance": instance, "job_id": job_id}]}, timeout=10)
    assert batch.json()["job_ids"] == [job_id]
    again = requests.get(f"{api}/jobs/{job_id}", timeout=10).json()
    assert again["result"] == first["result"] and again["attempts"] == {"init": 1, "run": 1, "eval": 1}
    assert marker.read_text() == "ran\n"


@pytest.mark.parametrize("body,field", BAD_BODIES)
def test_bad_bodies_are_400_and_enqueue_nothing(api, redis_client, body, field):
    before = redis_client.scard("prorl:status:queued"), redis_client.llen("init")
    resp = requests.post(f"{api}/jobs", json=body, timeout=10)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request" and error["field"] == field and error["message"]
    assert (redis_client.scard("prorl:status:queued"), redis_client.llen("init")) == before


def test_non_json_body_is_400(api):
    resp = requests.post(f"{api}/jobs", data="not json", headers={"Content-Type": "text/plain"}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request"


def test_unknown_ids_are_404(api):
    for method, path in [("GET", "/jobs/nope"), ("GET", "/jobs/nope/wait?timeout=0"), ("DELETE", "/jobs/nope")]:
        resp = requests.request(method, f"{api}{path}", timeout=10)
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found", (method, path)


def test_wait_returns_202_while_running(api):
    job_id = submit(api, shell("sleep 2"))
    resp = requests.get(f"{api}/jobs/{job_id}/wait", params={"timeout": 0.2}, timeout=10)
    assert resp.status_code == 202 and resp.json()["status"] in ("queued", "init", "run")
    assert wait(api, job_id)["status"] == "completed"


def test_a_failing_stage_ends_failed_with_that_stage(api):
    job_id = submit(api, {"data_source": "tests.handlers_for_tests:BrokenRunHandler", "sandbox": LOCAL})
    result = wait(api, job_id)["result"]
    assert result["status"] == "failed" and result["critical_error"] == "run"
    assert result["error"]["type"] == "RuntimeError" and "on purpose" in result["error"]["message"]
    assert result["filter"] is True


def test_cancel_a_queued_job(api):
    init_workers = requests.get(f"{api}/healthz", timeout=10).json()["worker_names"]["init"]
    celery_app.control.cancel_consumer("init", destination=init_workers, reply=True)
    try:
        job_id = submit(api, shell("echo never"))
        assert requests.get(f"{api}/jobs/{job_id}", timeout=10).json()["status"] == "queued"
        resp = requests.delete(f"{api}/jobs/{job_id}", timeout=10)
        assert resp.status_code == 200 and resp.json()["status"] == "cancelled"
    finally:
        celery_app.control.add_consumer("init", destination=init_workers, reply=True)
    view = wait(api, job_id)
    assert view["result"]["critical_error"] == "cancelled" and view["workers"] == {}
    again = requests.delete(f"{api}/jobs/{job_id}", timeout=10)
    assert again.status_code == 409 and again.json()["error"]["status"] == "cancelled"


def _sleepers(tag: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and tag in " ".join(p.info["cmdline"])]


def test_cancel_a_running_job_kills_its_command_and_sandbox(api):
    tag = f"{uuid.uuid4().int % 1000}.{uuid.uuid4().int % 1000 + 1}"  # a sleep nobody else runs
    job_id = submit(api, shell("echo started", f"sleep {tag}", "echo never"))
    wait_until(lambda: _sleepers(f"sleep {tag}"), 30, "the command to start")
    view = requests.get(f"{api}/jobs/{job_id}", timeout=10).json()
    assert view["status"] == "run"
    resp = requests.delete(f"{api}/jobs/{job_id}", timeout=10)
    assert resp.status_code == 200
    result = resp.json()["result"]
    assert result["status"] == "cancelled" and result["critical_error"] == "cancelled"
    assert [s["output"] for s in result["steps"]] == ["started\n"]  # the partial trajectory
    wait_until(lambda: not _sleepers(f"sleep {tag}"), 5, "the cancelled command to die")
    final = wait(api, job_id)
    assert final["status"] == "cancelled" and final["result"] == result  # never changes again


def test_killed_run_worker_does_not_strand_the_job(api, stack):
    job_id = submit(api, shell("echo before", "sleep 3", "echo after"))
    wait_until(lambda: requests.get(f"{api}/jobs/{job_id}", timeout=10).json()["status"] == "run",
               30, "the run stage")
    old = stack.children["worker-run"]
    restarts = stack.restarts.get("worker-run", 0)
    old.signal(signal.SIGKILL)
    old.popen.wait()
    view = wait(api, job_id, timeout=90)  # the stack's supervisor starts a new run worker
    assert stack.restarts["worker-run"] == restarts + 1 and stack.children["worker-run"].pid != old.pid
    assert view["status"] == "completed", view
    assert view["attempts"]["run"] == 2
    assert [s["output"] for s in view["result"]["steps"]][-1] == "after\n"
