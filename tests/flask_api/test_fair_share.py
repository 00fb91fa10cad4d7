"""Quotas and fair share on the running service, through real HTTP with projects' keys: a 429
quota refuses with Retry-After and a body naming it; a held one runs the job later and says so in
its timings; a project arriving behind another's backlog gets results long before that backlog
is done (the slow case)."""
from __future__ import annotations

import time
import uuid

import pytest
import redis
import requests

from prorl_celery.jobs import JobStore
from prorl_celery.projects import ProjectStore
from tests.conftest import wait_until

LOCAL = {"runtime": "local"}


def _project(redis_url: str, weight: float = 1.0, **quotas) -> tuple[str, dict]:
    store = ProjectStore(redis.Redis.from_url(redis_url))
    name = f"fs-{uuid.uuid4().hex[:8]}"
    key = store.add(name, weight).key
    if quotas:
        store.set_quotas(name, quotas)
    return name, {"Authorization": f"Bearer {key}"}


def _shell(*commands: str) -> dict:
    return {"instance": {"data_source": "shell", "commands": list(commands), "sandbox": LOCAL}}


def _post(api: str, headers: dict, jobs: list[dict]) -> requests.Response:
    return requests.post(f"{api}/jobs", json={"jobs": jobs}, headers=headers, timeout=30)


def _wait(api: str, headers: dict, job_id: str, timeout: float = 60) -> dict:
    resp = requests.get(f"{api}/jobs/{job_id}/wait", params={"timeout": timeout}, headers=headers,
                        timeout=timeout + 10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_429_quota_names_itself_and_when_to_come_back(stack, api, redis_url):
    _, key = _project(redis_url, max_in_flight=2, over={"max_in_flight": "429"})
    first = _post(api, key, [_shell("sleep 5"), _shell("sleep 5")])
    assert first.status_code == 202, first.text
    refused = _post(api, key, [_shell("true")])
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "over_quota" and error["quota"] == "max_in_flight" and error["limit"] == 2
    assert requests.post(f"{api}/cancel_all", json={}, headers=key, timeout=30).status_code == 200
    wait_until(lambda: _post(api, key, [_shell("true")]).status_code == 202, 30, "room after the cancel")


def test_a_held_job_runs_later_and_says_why(stack, api, redis_url):
    _, key = _project(redis_url, max_in_flight=1)
    ids = _post(api, key, [_shell("sleep 1"), _shell("true")]).json()["job_ids"]
    ended = [_wait(api, key, job_id) for job_id in ids]
    assert [e["status"] for e in ended] == ["completed", "completed"], ended
    assert ended[1]["timings"]["quota_held"] == "max_in_flight" and ended[1]["timings"]["quota_wait"] > 0
    assert ended[0]["timings"]["quota_held"] is None


def test_an_evaluation_overtakes_the_pending_training_rollouts(stack, api, redis_url):
    """One at a time (max_in_flight 1): the evaluation, submitted last with a higher priority, runs
    right after the one already running, before every training rollout still pending."""
    _, key = _project(redis_url, max_in_flight=1)
    first = _post(api, key, [_shell("sleep 1")]).json()["job_ids"]
    training = _post(api, key, [_shell("true") for _ in range(3)]).json()["job_ids"]
    evaluation = _post(api, key, [{**_shell("true"), "priority": 10}]).json()["job_ids"]
    store = JobStore(redis.Redis.from_url(redis_url))
    for job_id in first + training + evaluation:
        assert _wait(api, key, job_id)["status"] == "completed"
    started = {r.job_id: r.t_created + r.queue_s for r in store.get_many(first + training + evaluation)}
    assert started[first[0]] < started[evaluation[0]] < min(started[t] for t in training)


@pytest.mark.slow
def test_a_late_project_is_not_starved_by_a_backlog(stack, api, redis_url):
    """A submits 120 rollouts of half a second first, B then 5. With equal weights B's next job
    goes before A's next one, so B's first result waits at most for what was already released
    when it came: the stage queues' cap (fair_share_queue, 16) for init and again for the next
    stages, plus what the stages held (4 init, 8 run, 4 eval threads): 48 of A's, not 120."""
    a_name, a = _project(redis_url)
    _, b = _project(redis_url)
    store = JobStore(redis.Redis.from_url(redis_url))
    backlog = _post(api, a, [_shell("sleep 0.5") for _ in range(120)]).json()["job_ids"]
    wait_until(lambda: store.counts(a_name)["completed"] >= 4, 60, "A's first results")
    done_before = store.counts(a_name)["completed"]
    b_ids = _post(api, b, [_shell("true") for _ in range(5)]).json()["job_ids"]
    assert _wait(api, b, b_ids[0], 120)["status"] == "completed"
    a_meanwhile = store.counts(a_name)["completed"] - done_before
    assert a_meanwhile <= 2 * 16 + 16, a_meanwhile
    assert a_meanwhile < len(backlog) - done_before
    requests.post(f"{api}/cancel_all", json={}, headers=a, timeout=30)
    time.sleep(0.1)
