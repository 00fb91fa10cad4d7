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

from prorl_celery import keys
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
    """A submits 500 rollouts of half a second first, B then 20 (the issue's case). With equal
    weights B's next job goes before A's next one, so B's first result waits at most for what was
    already released when it came: the stage queues' cap (fair_share_queue, 16) for init and again
    for the next stages, plus what the stages held (4 init, 8 run, 4 eval threads): 48 of A's,
    not 500."""
    a_name, a = _project(redis_url)
    _, b = _project(redis_url)
    store = JobStore(redis.Redis.from_url(redis_url))
    backlog = _post(api, a, [_shell("sleep 0.5") for _ in range(500)]).json()["job_ids"]
    wait_until(lambda: store.counts(a_name)["completed"] >= 4, 60, "A's first results")
    done_before = store.counts(a_name)["completed"]
    b_ids = _post(api, b, [_shell("true") for _ in range(20)]).json()["job_ids"]
    assert _wait(api, b, b_ids[0], 120)["status"] == "completed"
    a_meanwhile = store.counts(a_name)["completed"] - done_before
    assert a_meanwhile <= 2 * 16 + 16, a_meanwhile
    assert a_meanwhile < len(backlog) - done_before
    requests.post(f"{api}/cancel_all", json={}, headers=a, timeout=30)
    time.sleep(0.1)


def _two_sandboxes(gate: str) -> dict:
    return {"instance": {"data_source": "tests.handlers_for_tests:TwoSandboxHandler", "gate": gate,
                         "sandbox": LOCAL}}


def test_max_sandboxes_counts_each_jobs_sandboxes_not_its_rollouts(stack, api, redis_url, tmp_path):
    """Two jobs that each hold two sandboxes at once, under max_sandboxes 2: the second stays
    pending while the first holds both (counting rollouts would run them side by side), the gauge
    says 2, and the second runs once the first ended, held by max_sandboxes."""
    name, key = _project(redis_url, max_sandboxes=2)
    first_gate, second_gate = tmp_path / "first", tmp_path / "second"
    first = _post(api, key, [_two_sandboxes(str(first_gate))]).json()["job_ids"][0]
    second = _post(api, key, [_two_sandboxes(str(second_gate))]).json()["job_ids"][0]
    view = lambda job_id: requests.get(f"{api}/jobs/{job_id}", headers=key, timeout=30).json()  # noqa: E731
    store = JobStore(redis.Redis.from_url(redis_url))
    wait_until(lambda: len((store.get(first).sandbox or {}).get("aux", [])) == 1, 60,
               "the first job's second sandbox, opened in its run beside its own")
    assert view(first)["status"] == "run"
    time.sleep(1.5)  # releases are tried at every stage start and end, and by the beat each second
    assert view(second)["status"] == "queued"
    metrics = requests.get(f"{api}/metrics", timeout=30).text  # the operator's token
    assert f'prorl_project_sandboxes{{project="{name}"}} 2.0' in metrics
    assert f'prorl_project_quota_held{{project="{name}",quota="max_sandboxes"}} 1.0' in metrics
    first_gate.touch()
    second_gate.touch()
    ended = [_wait(api, key, job_id) for job_id in (first, second)]
    assert [e["status"] for e in ended] == ["completed", "completed"], ended
    assert ended[1]["timings"]["quota_held"] == "max_sandboxes" and ended[1]["timings"]["quota_wait"] > 1
    records = store.get_many([first, second])
    assert records[1].t_created + records[1].queue_s >= records[0].t_finished - 0.05  # never side by side
    wait_until(lambda: f'prorl_project_sandboxes{{project="{name}"}} 0.0'
               in requests.get(f"{api}/metrics", timeout=30).text, 10, "the count back to 0")


def test_a_job_needing_more_sandboxes_than_the_quota_is_refused_at_submission(stack, api, redis_url):
    """The example ``ledger`` Harbor task holds four at once (the agent's, its two compose
    services', the verifier's): refused under max_sandboxes 3 with a 403 naming the field, nothing
    stored; accepted under 4 (held here by max_in_flight 0, then cancelled)."""
    from tests.conftest import ROOT

    ledger = {"instance": {"data_source": "harbor", "task_dir": str(ROOT / "examples" / "harbor" / "ledger")}}
    name, key = _project(redis_url, max_sandboxes=3)
    refused = _post(api, key, [ledger, {"instance": {"data_source": "echo", "text": "hi"}}])
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["type"] == "policy_denied" and error["field"] == "instance"
    assert "4 sandboxes" in error["message"] and "max_sandboxes (3)" in error["message"]
    store = JobStore(redis.Redis.from_url(redis_url))
    assert sum(store.counts(name).values()) == 0
    ProjectStore(redis.Redis.from_url(redis_url)).set_quotas(name, {"max_sandboxes": 4, "max_in_flight": 0})
    accepted = _post(api, key, [ledger])
    assert accepted.status_code == 202, accepted.text
    assert store.redis.hget(keys.job(accepted.json()["job_ids"][0]), "sandboxes") == b"4"
    assert requests.post(f"{api}/cancel_all", json={}, headers=key, timeout=30).status_code == 200


def test_a_projects_cost_is_what_its_sandboxs_cgroup_counted_and_reaches_its_totals(stack, api, redis_url):
    """A project's rollout (its key, real HTTP) that burns a second of CPU holding 100 MiB: its
    ``cost.sandbox`` is the host's cgroup reading (against the process's own rusage), and the
    project's totals in ``/metrics`` are exactly that job's."""
    import json

    from sandboxes.runtimes.limits.cgroups import accounting
    from tests.tasks.test_domains import BURN

    if accounting() is None:
        pytest.skip("no cgroup v1 cpuacct here (or not root): sandboxes are not measured")
    name, key = _project(redis_url)
    job_id = _post(api, key, [{"instance": {"data_source": "shell", "commands": [BURN],
                                            "sandbox": {"runtime": "bwrap"}}}]).json()["job_ids"][0]
    result = _wait(api, key, job_id)["result"]
    own_cpu, own_rss_kb, held = json.loads(result["steps"][0]["output"])
    spent = result["cost"]["sandbox"]
    assert spent["source"] == "cgroup" and spent["sandboxes"] == 1 and held == 100 << 20
    assert own_cpu <= spent["cpu_s"] <= own_cpu + 0.75, (own_cpu, spent)
    assert 100 <= spent["peak_memory_mb"] <= own_rss_kb / 1024 + 64, (own_rss_kb, spent)

    def totals() -> dict[str, float]:
        found = {}
        for line in requests.get(f"{api}/metrics", timeout=30).text.splitlines():
            if f'{{project="{name}"}}' in line and not line.startswith("#"):
                metric, value = line.rsplit(" ", 1)
                found[metric.split("{")[0]] = float(value)
        return found

    got = wait_until(lambda: (t := totals()).get("prorl_project_finished_total") == 1 and t, 10, "the totals")
    assert got["prorl_project_sandbox_cpu_seconds_total"] == pytest.approx(spent["cpu_s"], abs=1e-6)
    assert got["prorl_project_sandbox_peak_memory_mb"] == pytest.approx(spent["peak_memory_mb"], abs=1e-6)
    assert got["prorl_project_sandbox_measured_total"] == 1 and got["prorl_project_sandboxes"] == 0
