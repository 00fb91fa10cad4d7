"""Fair share and quotas in Redis (prorl_celery/fairshare.py): releases go by weight, by priority
within a project, stop at the stage-queue cap and at a project's quotas (the wait recorded on the
job), and a 429 quota refuses a submission before anything is pending."""
from __future__ import annotations

import uuid

import pytest
import redis

from prorl_celery import keys
from prorl_celery.errors import OverQuota, PolicyDenied
from prorl_celery.fairshare import FairShare
from prorl_celery.jobs import JobStore
from prorl_celery.models import JobRequest
from prorl_celery.projects import ProjectStore
from prorl_celery.status import JobStatus


@pytest.fixture
def fair(scratch_redis):
    """Fair share on a database no worker reads: the stack's own releases (at every stage start
    and end, and by the beat) would otherwise take these tests' pending jobs, and send them."""
    yield FairShare(scratch_redis)
    scratch_redis.flushdb()


def _project(fair: FairShare, weight: float = 1.0, **quotas) -> str:
    name = f"fs-{uuid.uuid4().hex[:8]}"
    store = ProjectStore(fair.redis)
    store.add(name, weight)
    if quotas:
        store.set_quotas(name, quotas)
    return name


def _submit(fair: FairShare, project: str, n: int, priority: int = 0) -> list[str]:
    named = [(f"{project}-{priority}-{uuid.uuid4().hex[:6]}",
              JobRequest(instance={"data_source": "echo"}, priority=priority)) for _ in range(n)]
    fair.enqueue(project, [(job_id, req.priority) for job_id, req in named])
    JobStore(fair.redis).create_many(named, project)
    return [job_id for job_id, _ in named]


def _start(fair: FairShare, job_id: str, status: str = "run") -> None:
    """What a stage start does to the job's hash and its project's counts (the transition script's
    work; the release script reads only these)."""
    project = fair.redis.hget(keys.job(job_id), "project").decode()
    fair.redis.hset(keys.job(job_id), mapping={"status": status, "stage_state": "running"})
    fair.redis.hincrby(keys.job_counts_of(project), f"{status}|echo", 1)


def _metrics(fair: FairShare) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from prorl_celery.metrics import ServiceCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(JobStore(fair.redis)))
    return generate_latest(registry).decode()


def _end(fair: FairShare, job_id: str) -> None:
    project = fair.redis.hget(keys.job(job_id), "project").decode()
    fair.redis.hset(keys.job(job_id), "status", "completed")
    fair.redis.hincrby(keys.job_counts_of(project), "run|echo", -1)


def test_releases_follow_the_weights_and_the_cap(fair):
    heavy, light = _project(fair, weight=3), _project(fair, weight=1)
    _submit(fair, heavy, 40)
    _submit(fair, light, 40)
    assert len(fair.release(cap=4)) == 4
    assert fair.release(cap=4) == []  # four wait in the queues: nothing more until one starts
    order = []
    for _ in range(40):
        waiting = [m.decode() for m in fair.redis.smembers(keys.fair_waiting())]
        _start(fair, waiting[0])
        order += [job_id for job_id, _ in fair.release(started=waiting[0], cap=4)]
    share = sum(job_id.startswith(heavy) for job_id in order) / len(order)
    assert abs(share - 0.75) <= 0.05, order


def test_a_new_project_does_not_wait_behind_a_backlog(fair):
    first, late = _project(fair), _project(fair)
    _submit(fair, first, 200)
    released = [j for j, _ in fair.release(cap=2)]
    _submit(fair, late, 3)
    for job_id in released:
        _start(fair, job_id)
    assert any(j.startswith(late) for j, _ in fair.release(cap=2))


def test_priority_within_a_project(fair):
    project = _project(fair)
    training = _submit(fair, project, 5, priority=0)
    evaluation = _submit(fair, project, 2, priority=10)
    released = [j for j, _ in fair.release(cap=3)]
    assert released[:2] == evaluation and released[2] == training[0]


def test_max_in_flight_holds_and_records_the_wait(fair):
    project = _project(fair, max_in_flight=2)
    ids = _submit(fair, project, 4)
    assert [j for j, _ in fair.release(cap=10)] == ids[:2]
    for job_id in ids[:2]:
        _start(fair, job_id)
    assert fair.release(cap=10) == []  # two in a stage: at the quota
    assert fair.redis.hget(keys.fair_held(), project).decode().endswith("|max_in_flight")
    metrics = _metrics(fair)
    assert f'prorl_project_quota_held{{project="{project}",quota="max_in_flight"}} 1.0' in metrics
    assert f'prorl_project_pending{{project="{project}"}} 2.0' in metrics
    _end(fair, ids[0])
    assert [j for j, _ in fair.release(cap=10)] == [ids[2]]
    record = JobStore(fair.redis).get(ids[2])
    assert record.quota_held == "max_in_flight" and record.timings().quota_wait >= 0


def _submit_needing(fair: FairShare, project: str, n: int, need: int) -> list[str]:
    """``n`` jobs each needing ``need`` sandboxes at once, submitted as tasks/chain.py does."""
    named = [(f"{project}-n{need}-{uuid.uuid4().hex[:6]}", JobRequest(instance={"data_source": "echo"}))
             for _ in range(n)]
    fair.enqueue(project, [(job_id, 0, need) for job_id, _ in named])
    JobStore(fair.redis).create_many(named, project, needs=[need] * n)
    return [job_id for job_id, _ in named]


def _move(fair: FairShare, job_id: str, *path: str) -> None:
    """The job through ``path`` by the store's own transition script (which keeps the project's
    sandboxes held), as the stages move it."""
    store = JobStore(fair.redis)
    for status in path:
        ok, now = store.transition(job_id, JobStatus(status))
        assert ok, (job_id, status, now)


def _held(fair: FairShare, project: str) -> int:
    return fair.sandboxes([project])[0]


def test_max_sandboxes_sums_each_jobs_need(fair):
    """Jobs needing two sandboxes each (a task with a verifier's sandbox beside the agent's) under
    max_sandboxes 2: one at a time, where counting rollouts would release two."""
    project = _project(fair, max_sandboxes=2)
    ids = _submit_needing(fair, project, 3, need=2)
    assert [j for j, _ in fair.release(cap=10)] == ids[:1]
    assert fair.release(cap=10) == []  # the released one will hold both
    assert fair.redis.hget(keys.fair_held(), project).decode().endswith("|max_sandboxes")
    _move(fair, ids[0], "init")
    assert _held(fair, project) == 2 and fair.release(started=ids[0], cap=10) == []
    assert f'prorl_project_sandboxes{{project="{project}"}} 2.0' in _metrics(fair)
    _move(fair, ids[0], "run", "eval", "completed")
    assert _held(fair, project) == 0
    assert [j for j, _ in fair.release(cap=10)] == ids[1:2]
    record = JobStore(fair.redis).get(ids[1])
    assert record.quota_held == "max_sandboxes"

    rollouts = _project(fair, max_in_flight=2)  # the same jobs counted as rollouts: two at once
    others = _submit_needing(fair, rollouts, 3, need=2)
    assert [j for j, _ in fair.release(cap=10)] == others[:2]


def test_max_sandboxes_sums_the_stages_and_the_released(fair):
    project = _project(fair, max_sandboxes=3)
    small = _submit_needing(fair, project, 1, need=1)
    big = _submit_needing(fair, project, 1, need=3)
    assert [j for j, _ in fair.release(cap=10)] == small  # 1 + 3 > 3: the big one waits
    _move(fair, small[0], "init", "run")
    assert _held(fair, project) == 1 and fair.release(cap=10) == []
    _move(fair, small[0], "failed")
    assert [j for j, _ in fair.release(cap=10)] == big
    _move(fair, big[0], "init")
    assert _held(fair, project) == 3
    _move(fair, big[0], "queued")  # an infrastructure fault: back to queued, its sandboxes closed
    assert _held(fair, project) == 0
    _move(fair, big[0], "init", "cancelled")
    assert _held(fair, project) == 0


def test_one_projects_sandboxes_never_hold_anothers(fair):
    a, b = _project(fair, max_sandboxes=2), _project(fair, max_sandboxes=2)
    (a_job,) = _submit_needing(fair, a, 1, need=2)
    assert [j for j, _ in fair.release(cap=10)] == [a_job]
    _move(fair, a_job, "init")
    b_jobs = _submit_needing(fair, b, 2, need=2)
    assert [j for j, _ in fair.release(cap=10)] == b_jobs[:1]  # a's two are a's alone
    assert fair.sandboxes([a, b]) == [2, 0]


def test_a_job_in_a_stage_from_before_needs_were_counted_takes_nothing_back(fair):
    """A job that entered its stage before the count was kept (the old script: no ``sandboxes``,
    no ``sandboxes_held``) leaves it without driving the count below what the others hold."""
    project = _project(fair, max_sandboxes=5)
    old, new = _submit(fair, project, 2)  # no need given, none stored: each counts 1
    assert fair.redis.hget(keys.job(old), "sandboxes") is None
    fair.release(cap=10)
    _start(fair, old, "init")  # by hand, as before: nothing added to the count
    _move(fair, new, "init")
    assert _held(fair, project) == 1
    _move(fair, old, "failed")
    assert _held(fair, project) == 1
    _move(fair, new, "failed")
    assert _held(fair, project) == 0


def test_a_job_needing_more_than_max_sandboxes_is_refused_whatever_over_says(fair):
    project = _project(fair, max_sandboxes=2)
    with pytest.raises(PolicyDenied) as refused:
        _submit_needing(fair, project, 1, need=3)
    assert refused.value.field == "instance" and "max_sandboxes (2)" in str(refused.value)
    assert fair.pending(project) == 0
    fine = _submit_needing(fair, project, 2, need=2)
    assert fair.pending(project) == 2 and len(fine) == 2


def test_a_429_max_sandboxes_sums_needs(fair):
    project = _project(fair, max_sandboxes=4, over={"max_sandboxes": "429"})
    _submit_needing(fair, project, 1, need=3)
    with pytest.raises(OverQuota) as refused:
        _submit_needing(fair, project, 1, need=2)  # 3 + 2 > 4
    assert refused.value.quota == "max_sandboxes" and refused.value.limit == 4
    _submit_needing(fair, project, 1, need=1)  # 3 + 1 fits
    assert fair.pending(project) == 2


def test_a_harbor_tasks_need_counts_its_sidecars_and_its_verifier():
    """At submission, from the task folder: the agent's sandbox, one per compose service, and the
    verifier's fresh one (opened while the agent's lives); the operator's shared verifier grades
    in the agent's own."""
    from tasks.handlers import sandbox_need, sandbox_needs
    from tests.conftest import ROOT

    ledger = {"data_source": "harbor", "task_dir": str(ROOT / "examples" / "harbor" / "ledger")}
    hello = {"data_source": "harbor", "task_dir": str(ROOT / "examples" / "harbor" / "hello")}
    assert sandbox_need(ledger) == 4  # main, ledger, seed, the verifier
    assert sandbox_need(hello) == 2
    assert sandbox_needs([{"data_source": "echo"}, ledger, hello, ledger]) == [1, 4, 2, 4]
    assert sandbox_need({"data_source": "tests.handlers_for_tests:TwoSandboxHandler"}) == 2
    assert sandbox_need({"data_source": "tests.handlers_for_tests:GateHandler"}) == 1  # no hook: 1


def test_a_shared_verifier_grades_in_the_agents_sandbox(tmp_path, monkeypatch):
    import shutil

    from config.settings import get_settings
    from tasks.handlers import sandbox_need
    from tests.conftest import ROOT

    task = shutil.copytree(ROOT / "examples" / "harbor" / "hello", tmp_path / "hello-shared")
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]\n", '[verifier]\nenvironment_mode = "shared"\n'))
    instance = {"data_source": "harbor", "task_dir": str(task)}
    assert sandbox_need(instance) == 2  # the operator has not opted in: graded apart all the same
    monkeypatch.setenv("PRORL_HARBOR_SHARED_VERIFIER", "1")
    get_settings.cache_clear()
    try:
        assert sandbox_need(instance) == 1
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()


def test_a_429_quota_refuses_before_anything_is_pending(fair):
    project = _project(fair, max_in_flight=3, over={"max_in_flight": "429"})
    _submit(fair, project, 3)
    with pytest.raises(OverQuota) as refused:
        _submit(fair, project, 1)
    assert refused.value.quota == "max_in_flight" and refused.value.retry_after >= 1
    assert fair.pending(project) == 3


def test_tokens_per_hour_429_says_when(fair):
    project = _project(fair, tokens_per_hour=100, over={"tokens_per_hour": "429"})
    import time

    fair.routing.hset(keys.llm_project_tokens(project), int(time.time() // 60), 150)
    with pytest.raises(OverQuota) as refused:
        _submit(fair, project, 1)
    assert refused.value.quota == "tokens_per_hour" and 1 <= refused.value.retry_after <= 3600


def test_a_cancelled_pending_job_leaves_its_list_and_is_never_released(fair):
    from tasks.chain import cancel_many

    project = _project(fair)
    ids = _submit(fair, project, 3)
    store = JobStore(fair.redis)
    assert cancel_many(store, store.get_many(ids)) == ids
    assert fair.pending(project) == 0
    fair.redis.zadd(keys.fair_pending(project), {ids[0]: -1})  # as if the forget had been lost
    fair.redis.zadd(keys.fair_active(), {project: 0})
    assert fair.release(cap=10) == [] and fair.pending(project) == 0


def test_concurrent_submissions_never_pass_a_429_quota_together(fair, redis_url):
    """Twenty submitters at once (each its own connection, as API processes are), room for five:
    exactly five are taken, the check and the add being one script."""
    project = _project(fair, max_in_flight=5, over={"max_in_flight": "429"})
    assert _racing_enqueues(redis_url, project, lambda i: (f"{project}-c{i}", 0)) == 5
    assert fair.pending(project) == 5


def _racing_enqueues(redis_url: str, project: str, job) -> int:
    """20 threads, each its own connection, enqueue ``job(i)`` at once: how many were taken."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> bool:
        try:
            scratch = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/12")  # scratch_redis's database
            FairShare(scratch).enqueue(project, [job(i)])
        except OverQuota:
            return False
        return True

    with ThreadPoolExecutor(20) as pool:
        return sum(pool.map(one, range(20)))


def test_concurrent_submissions_never_pass_a_429_max_sandboxes_together(fair, redis_url):
    """The same with jobs needing 2 under max_sandboxes 10: exactly five taken. A pending job's
    need is kept with it from the enqueue on, before its record is stored."""
    project = _project(fair, max_sandboxes=10, over={"max_sandboxes": "429"})
    assert _racing_enqueues(redis_url, project, lambda i: (f"{project}-s{i}", 0, 2)) == 5
    assert fair.pending(project) == 5
