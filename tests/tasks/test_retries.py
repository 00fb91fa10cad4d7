"""Infrastructure faults cost a retry, not a sample (issue 13 item 4), on the session stack:
real workers, a real Redis, real sandbox hosts."""
from __future__ import annotations

import signal

import redis
import requests

from prorl_celery import keys
from prorl_celery.connections import get_store
from tests.conftest import submit, wait, wait_until

SHELL = ["echo up", "sleep 4", "echo done"]


def _completions(redis_url: str, job_id: str) -> int:
    client = redis.Redis.from_url(redis_url)
    return sum(1 for _, entry in client.xrange(keys.completions()) if entry[b"job_id"].decode() == job_id)


def test_a_job_whose_host_is_killed_mid_run_completes_on_another_host(stack, api):
    second = stack.start_sandbox_host("sandbox-host-2")
    try:
        job_id = submit(api, {"data_source": "shell", "commands": SHELL})
        record = wait_until(lambda: (r := get_store().get(job_id)) and len(r.state.get("steps", [])) == 1 and r,
                            30, "the first step")
        host_id = record.sandbox["host_id"]
        name = "sandbox-host-2" if "-sandbox-host-2-" in host_id else "sandbox-host"  # see start_sandbox_host
        stack.pause_supervision(name)  # stays dead: the retry must find the other host
        stack.children[name].signal(signal.SIGKILL)
        stack.children[name].popen.wait()
        view = wait(api, job_id, timeout=90)
        result = view["result"]
        assert view["status"] == "completed" and result["reward"] == 1.0, result
        first, last = result["attempts"]
        assert first["attempt"] == 1 and first["host"] == host_id and first["stage"] == "run"
        assert first["fault"] in {"sandbox_host_unreachable", "sandbox_gone", "sandbox_host_lost"}, first
        assert last["attempt"] == 2 and last["fault"] is None and last["host"] != host_id
        assert [s["command"] for s in result["steps"]] == SHELL  # the second attempt's, alone
        assert _completions(stack.redis_url, job_id) == 1
    finally:
        for name in ("sandbox-host", "sandbox-host-2"):
            stack._paused.discard(name)
        stack.pause_supervision("sandbox-host-2")
        second.stop()
        wait_until(lambda: stack.children["sandbox-host"].alive(), 30, "the first host back")


def test_a_fault_of_the_task_is_not_retried(api):
    job_id = submit(api, {"data_source": "tests.handlers_for_retries:FailingGraderHandler",
                          "commands": ["true"], "sandbox": {"runtime": "local"}})
    view = wait(api, job_id)
    assert view["status"] == "failed" and view["result"]["critical_error"] == "eval", view["result"]
    assert [a["fault"] for a in view["result"]["attempts"]] == ["ValueError"]
    assert get_store().get(job_id).attempt == 1


def test_attempts_exhausted_end_failed_with_every_attempt(stack, api):
    job_id = submit(api, {"data_source": "tests.handlers_for_retries:SandboxVanishesHandler",
                          "commands": [], "sandbox": {"runtime": "local"}})
    view = wait(api, job_id, timeout=90)
    result = view["result"]
    assert view["status"] == "failed" and result["critical_error"] == "sandbox", result
    assert [(a["attempt"], a["stage"], a["fault"]) for a in result["attempts"]] == \
        [(n, "run", "sandbox_gone") for n in (1, 2, 3)]  # job_max_attempts = 3 (the default)
    assert all(a["host"] for a in result["attempts"]) and result["error"]["type"] == "sandbox_gone"
    assert _completions(stack.redis_url, job_id) == 1


def test_a_restarted_host_answers_gone_for_its_predecessors_handles(stack):
    """Not 401: a handle from before the restart names a sandbox that is gone."""
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    addresses = [client.hget(keys.host(host_id), "address") for host_id in client.zrange(keys.hosts(), 0, -1)]
    address = next(a for a in addresses if _answers(f"{a}/health"))  # a host an earlier test killed may linger
    reply = requests.post(f"{address}/sandboxes/0123456789abcdef/exec", json={"command": "id"},
                          headers={"Authorization": "Bearer the-old-token"}, timeout=10)
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "sandbox_gone"
    reply = requests.get(f"{address}/sandboxes", headers={"Authorization": "Bearer the-old-token"}, timeout=10)
    assert reply.status_code == 401


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code < 500
    except requests.RequestException:
        return False

