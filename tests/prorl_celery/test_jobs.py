"""The job store against a real Redis: compare-and-set transitions, terminal states, counts."""
from __future__ import annotations

import threading
import uuid

import pytest

from prorl_celery.jobs import JobStore
from prorl_celery.models import JobRequest
from prorl_celery.status import PIPELINE, STAGES, TERMINAL, JobStatus, StageState

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)


@pytest.fixture
def redis_client(scratch_redis):
    """Jobs put in a running stage by hand live where no sweep ends them (tests/unit_tier.py)."""
    return scratch_redis


@pytest.fixture
def store(redis_client):
    return JobStore(redis_client, job_ttl_s=60)


def _new(store: JobStore, **extra) -> str:
    job_id = uuid.uuid4().hex
    assert store.create_many([(job_id, JobRequest(instance={"data_source": "shell"}, **extra))]) == [True]
    return job_id


def _at(store: JobStore, status: JobStatus) -> str:
    """A new job walked along the pipeline up to ``status`` (queued, a stage or completed)."""
    job_id = _new(store)
    for step in PIPELINE[1:PIPELINE.index(status) + 1]:
        assert store.transition(job_id, step)[0]
    assert store.status(job_id) is status
    return job_id


def test_create_is_idempotent(store):
    job_id = _new(store, group_id="g1")
    again = JobRequest(instance={"data_source": "other"}, group_id="g2")
    assert store.create_many([(job_id, again)]) == [False]
    record = store.get(job_id)
    assert record.data_source == "shell" and record.group_id == "g1"
    assert record.status is JobStatus.QUEUED
    assert job_id in store.group_ids("g1")


def test_transition_follows_the_table(store):
    job_id = _new(store)
    assert store.transition(job_id, JobStatus.RUN) == (False, JobStatus.QUEUED)  # init comes first
    assert store.transition(job_id, JobStatus.INIT, stage_state=StageState.RUNNING) == (True, JobStatus.INIT)
    assert store.get(job_id).stage_state is StageState.RUNNING
    assert job_id in store.ids_in(JobStatus.INIT) and job_id not in store.ids_in(JobStatus.QUEUED)


@pytest.mark.parametrize("source,target", [(JobStatus.QUEUED, JobStatus.RUN), (JobStatus.QUEUED, JobStatus.EVAL),
                                           (JobStatus.QUEUED, JobStatus.COMPLETED), (JobStatus.INIT, JobStatus.EVAL),
                                           (JobStatus.INIT, JobStatus.COMPLETED), (JobStatus.RUN, JobStatus.INIT),
                                           (JobStatus.EVAL, JobStatus.INIT), (JobStatus.EVAL, JobStatus.RUN),
                                           (JobStatus.QUEUED, JobStatus.QUEUED),
                                           (JobStatus.COMPLETED, JobStatus.RUN),
                                           (JobStatus.COMPLETED, JobStatus.QUEUED)])
def test_the_store_refuses_what_the_table_forbids(store, source, target):
    job_id = _at(store, source)
    before = store.redis.hgetall(f"prorl:job:{job_id}")
    assert store.transition(job_id, target, state={"x": 1}) == (False, source)
    assert store.redis.hgetall(f"prorl:job:{job_id}") == before  # not one field written


def test_the_store_allows_every_move_the_service_makes(store):
    # the stages: admit (each from the one before, and again on a redelivery), then done
    job_id = _new(store)
    for stage in STAGES:
        for _ in range(2):
            ok, status = store.transition(job_id, stage, expect={"attempt": 1}, stage_state=StageState.RUNNING)
            assert (ok, status) == (True, stage)
        # the sweep re-sends a stage whose lease lapsed (narrowed: still this stage, still running)
        redispatch = dict(sources=[stage], require_state=StageState.RUNNING, stage_state=StageState.REDISPATCHED)
        assert store.transition(job_id, None, **redispatch) == (True, stage)
        assert store.transition(job_id, stage, stage_state=StageState.RUNNING) == (True, stage)
        assert store.transition(job_id, None, sources=[stage], stage_state=StageState.DONE)[0]
        assert store.transition(job_id, None, **redispatch) == (False, stage)  # done: nothing to re-send
    assert store.transition(job_id, JobStatus.COMPLETED) == (True, JobStatus.COMPLETED)
    # a retry from init, from every stage: back to queued, attempt + 1
    for stage in STAGES:
        job_id = _at(store, stage)
        assert store.transition(job_id, JobStatus.QUEUED, expect={"attempt": 1}, attempt=2,
                                stage_state=StageState.NONE) == (True, JobStatus.QUEUED)
        assert store.transition(job_id, JobStatus.QUEUED, expect={"attempt": 1}) == (False, JobStatus.QUEUED)
        assert store.transition(job_id, JobStatus.INIT, expect={"attempt": 2}) == (True, JobStatus.INIT)
    # failed / timeout from every active status; cancel many at once from every active status
    for ending in (JobStatus.FAILED, JobStatus.TIMEOUT):
        for status in (JobStatus.QUEUED, *STAGES):
            assert store.transition(_at(store, status), ending) == (True, ending)
    ids = [_at(store, status) for status in (JobStatus.QUEUED, *STAGES)] + [_at(store, JobStatus.COMPLETED)]
    done = store.transition_many((job_id, JobStatus.CANCELLED, {"result": {}}) for job_id in ids)
    assert done == [(True, JobStatus.CANCELLED)] * 4 + [(False, JobStatus.COMPLETED)]


def test_narrowing_must_stay_inside_the_table(store):
    job_id = _at(store, JobStatus.RUN)
    assert store.transition(job_id, JobStatus.FAILED, sources=[JobStatus.EVAL]) == (False, JobStatus.RUN)
    with pytest.raises(ValueError):  # a call site cannot widen the table
        store.transition(job_id, JobStatus.EVAL, sources=[JobStatus.QUEUED])
    with pytest.raises(ValueError):  # nor write a stage state outside the vocabulary
        store.update(job_id, stage_state="finished")
    assert store.get(job_id).stage_state is StageState.NONE


def test_stage_times_are_typed(store):
    job_id = _at(store, JobStatus.RUN)
    record = store.get(job_id)
    assert record.add_stage_time(JobStatus.RUN, 1.5) == {"run_s": 1.5}
    assert record.add_stage_time(JobStatus.RUN, 0.5) == {"run_s": 2.0}
    assert record.stage_times() == {"init_s": 0.0, "run_s": 2.0, "eval_s": 0.0}
    with pytest.raises(KeyError):
        record.add_stage_time(JobStatus.QUEUED, 1.0)
    assert store.update(job_id, **record.stage_times())
    assert store.get(job_id).timings().run == 2.0


@pytest.mark.parametrize("ending", sorted(TERMINAL, key=str))
def test_terminal_is_final(store, ending):
    job_id = _at(store, JobStatus.EVAL)
    assert store.transition(job_id, ending, result={"job_id": job_id, "status": ending.value})[0]
    for target in [*JobStatus, None]:
        ok, status = store.transition(job_id, target, state={"x": 1})
        assert not ok and status is ending
    record = store.get(job_id)
    assert record.status is ending and record.state == {}
    assert job_id not in store.ids_in(ending)  # terminal jobs are counted, not kept in sets
    assert store.redis.ttl(f"prorl:job:{job_id}") > 0


def test_concurrent_endings_only_one_wins(store):
    job_id = _at(store, JobStatus.EVAL)
    wins: list[JobStatus] = []
    barrier = threading.Barrier(8)

    def end(status: JobStatus) -> None:
        barrier.wait()
        if store.transition(job_id, status)[0]:
            wins.append(status)

    threads = [threading.Thread(target=end, args=(s,)) for s in
               [JobStatus.COMPLETED, JobStatus.CANCELLED, JobStatus.FAILED, JobStatus.TIMEOUT] * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.status(job_id) is wins[0]


def test_unknown_job(store):
    assert store.get("nope") is None
    assert store.transition("nope", JobStatus.CANCELLED) == (False, None)


def test_counts_and_completion_streams(store):
    before = store.counts_by_source()
    a, b = _new(store, group_id="gc"), _new(store)
    assert store.counts_by_source()[("queued", "shell")] == before.get(("queued", "shell"), 0) + 2
    last = store.redis.xrevrange("prorl:completions", count=1)
    cursor = last[0][0] if last else b"0-0"
    for stage in [*STAGES, JobStatus.COMPLETED]:
        assert store.transition(a, stage)[0]
    store.transition(b, JobStatus.CANCELLED)
    store.transition(b, JobStatus.FAILED)  # refused: already terminal, so no second entry
    counts = store.counts_by_source()
    assert counts[("queued", "shell")] == before.get(("queued", "shell"), 0)
    assert all(counts[(s.value, "shell")] == before.get((s.value, "shell"), 0) for s in STAGES)
    assert counts[("completed", "shell")] == before.get(("completed", "shell"), 0) + 1
    entries = store.redis.xrange("prorl:completions", min=f"({cursor.decode()}")
    assert [(e[b"job_id"], e[b"status"]) for _, e in entries] == [(a.encode(), b"completed"),
                                                                  (b.encode(), b"cancelled")]
    group = store.redis.xrange("prorl:completions:group:gc")
    assert [e[b"job_id"] for _, e in group] == [a.encode()]


def test_finish_watcher_wakes_a_waiter_when_its_job_ends(store):
    """The waiters are woken by the completion stream: they wait up to 120 s and would look at
    the status again only then, yet they return within the join's 15 s."""
    from prorl_celery.completions import FinishWatcher

    watcher = FinishWatcher(store, recheck_s=120)
    job_id, other = _new(store), _new(store)
    assert watcher.wait(job_id, 0.05) is JobStatus.QUEUED  # the timeout passes: not terminal
    assert watcher.wait("no-such-job", 5) is None
    seen = {}
    waiters = [threading.Thread(target=lambda i=i: seen.update({i: watcher.wait(job_id, 120)})) for i in range(3)]
    for thread in waiters:
        thread.start()
    store.transition(other, JobStatus.CANCELLED)  # someone else's end wakes nobody here for good
    store.transition(job_id, JobStatus.CANCELLED)
    for thread in waiters:
        thread.join(timeout=15)
    assert not any(thread.is_alive() for thread in waiters)
    assert seen == {0: JobStatus.CANCELLED, 1: JobStatus.CANCELLED, 2: JobStatus.CANCELLED}
    assert watcher._waiters == {}


def test_light_records_carry_status_stage_and_sandbox_but_not_the_conversation(store):
    job_id = _new(store, sampling_params={"run_budget_s": 5})
    handle = {"sandbox_id": "s1", "host_id": "h1"}
    store.transition(job_id, JobStatus.INIT, stage_state=StageState.RUNNING, sandbox=handle, attempt=2,
                     state={"agent": {"messages": ["x" * 1000]}}, t_stage_start=12.5)
    full, = store.get_many([job_id])
    light, gone = store.get_many([job_id, "no-such-job"], light=True)
    assert gone is None
    assert (light.status, light.stage_state, light.sandbox, light.attempt, light.t_stage_start) == \
        (JobStatus.INIT, StageState.RUNNING, handle, 2, 12.5)
    assert light.sampling_params == {"run_budget_s": 5} and light.data_source == "shell"
    assert full.state["agent"]["messages"] == ["x" * 1000] and full.instance["data_source"] == "shell"
    assert light.state == {} and light.instance == {} and light.result is None


def test_a_change_releases_the_stage_lease_it_names_with_the_callers_commands_first(store, redis_client):
    """``lease_token``: the change that ends a stage releases the stage lease in the same step,
    only if it happened and the lease still holds that token; ``before``: the caller's commands
    go in the same round trip, once, whatever the change's outcome."""
    from prorl_celery import keys

    job_id = _at(store, JobStatus.INIT)
    lease, counter = keys.stage_lease(job_id), f"test:before:{uuid.uuid4().hex}"
    redis_client.set(lease, "mine")
    bump = lambda pipe: pipe.incr(counter)  # noqa: E731
    assert store.transition(job_id, None, sources=[JobStatus.RUN], lease_token="mine", before=bump) == \
        (False, JobStatus.INIT)
    assert redis_client.get(lease) == b"mine" and redis_client.get(counter) == b"1"  # refused: kept
    assert store.transition(job_id, None, sources=[JobStatus.INIT], lease_token="theirs",
                            stage_state=StageState.DONE)[0]
    assert redis_client.get(lease) == b"mine"  # another holder's token: kept
    assert store.transition(job_id, None, sources=[JobStatus.INIT], lease_token="mine", before=bump,
                            stage_state=StageState.DONE) == (True, JobStatus.INIT)
    assert redis_client.get(lease) is None and redis_client.get(counter) == b"2"
    redis_client.script_flush()  # a Redis that lost its scripts: the change still happens, once
    redis_client.set(lease, "mine")
    assert store.transition(job_id, None, sources=[JobStatus.INIT], lease_token="mine", before=bump,
                            stage_state=StageState.DONE)[0]
    assert redis_client.get(lease) is None and redis_client.get(counter) == b"3"


def test_a_change_that_takes_the_stage_lease_happens_only_with_it(store, redis_client):
    """``take_lease_ms``: the change takes the stage lease once its checks pass, and does not
    happen (nothing written) when another delivery holds it."""
    from prorl_celery import keys

    job_id = _new(store)
    lease = keys.stage_lease(job_id)
    redis_client.set(lease, "theirs")
    assert store.transition(job_id, JobStatus.INIT, lease_token="mine", take_lease_ms=60000,
                            stage_state=StageState.RUNNING) == (False, JobStatus.QUEUED)
    assert store.status(job_id) is JobStatus.QUEUED and redis_client.get(lease) == b"theirs"
    redis_client.delete(lease)
    assert store.transition(job_id, JobStatus.RUN, lease_token="mine", take_lease_ms=60000)[0] is False
    assert redis_client.get(lease) is None  # refused by its checks: no lease taken
    assert store.transition(job_id, JobStatus.INIT, lease_token="mine", take_lease_ms=60000,
                            stage_state=StageState.RUNNING) == (True, JobStatus.INIT)
    assert redis_client.get(lease) == b"mine" and 0 < redis_client.pttl(lease) <= 60000


def test_a_stage_is_admitted_in_one_step_with_its_counts_worker_and_wait(store):
    """``admit``: the record as it was, and the change a stage delivery makes (running, the lease
    taken, its count, its worker, the wait since it was enqueued) in one script."""
    from prorl_celery import keys

    assert store.admit("nope", JobStatus.INIT, "w", "t0", 5000) is None
    job_id = _new(store)
    store.redis.hset(keys.job(job_id), mapping={"t_enqueued": 100.0, "queue_s": 1.5})
    first = store.admit(job_id, JobStatus.INIT, "init@a", "t1", 5000, now=102.0, t_stage_start=102.0)
    assert first.admitted and first.why == ""
    assert first.record.status is JobStatus.QUEUED  # as it was
    assert first.record.attempts == {"init": 1} and first.record.queue_s == pytest.approx(3.5)
    now = store.get(job_id)
    assert (now.status, now.stage_state) == (JobStatus.INIT, StageState.RUNNING)
    assert now.workers == {"init": "init@a"} and now.attempts == {"init": 1}
    assert now.queue_s == pytest.approx(3.5) and now.t_stage_start == 102.0
    assert store.redis.get(keys.stage_lease(job_id)) == b"t1"
    assert store.counts()["init"] >= 1 and job_id in store.ids_in(JobStatus.INIT)
    # a second delivery while the first holds the lease; the next stage's, early
    held = store.admit(job_id, JobStatus.INIT, "init@b", "t2", 5000, now=103.0)
    assert not held.admitted and held.why == "leased" and held.record.attempts == {"init": 1}
    early = store.admit(job_id, JobStatus.RUN, "run@a", "t3", 5000)
    assert not early.admitted and early.why == "early"
    # the lease lapsed (its holder died): the stage resumes, counted again, no wait added
    store.redis.delete(keys.stage_lease(job_id))
    again = store.admit(job_id, JobStatus.INIT, "init@b", "t4", 5000, now=110.0)
    assert again.admitted and again.record.status is JobStatus.INIT
    assert again.record.attempts == {"init": 2} and again.record.queue_s == pytest.approx(3.5)
    assert store.get(job_id).workers == {"init": "init@b"}
    # done: a duplicate of it is refused, the next stage admitted with the first stage's counts kept
    assert store.transition(job_id, None, sources=[JobStatus.INIT], stage_state=StageState.DONE,
                            t_enqueued=120.0)[0]
    store.redis.delete(keys.stage_lease(job_id))
    duplicate = store.admit(job_id, JobStatus.INIT, "init@c", "t5", 5000)
    assert not duplicate.admitted and duplicate.why == "done"
    run = store.admit(job_id, JobStatus.RUN, "run@a", "t6", 5000, now=121.25)
    assert run.admitted and run.record.attempts == {"init": 2, "run": 1}
    assert run.record.queue_s == pytest.approx(4.75)
    assert store.get(job_id).workers == {"init": "init@b", "run": "run@a"}
    assert not store.admit(job_id, JobStatus.INIT, "init@d", "t7", 5000).admitted  # behind it: a duplicate
    # ended: refused, and the record says so
    store.redis.delete(keys.stage_lease(job_id))
    assert store.transition(job_id, JobStatus.CANCELLED)[0]
    ended = store.admit(job_id, JobStatus.EVAL, "eval@a", "t8", 5000)
    assert not ended.admitted and ended.record.status is JobStatus.CANCELLED
    assert store.redis.get(keys.stage_lease(job_id)) is None


def test_admission_takes_a_projects_sandboxes_as_a_change_does(store):
    job_id = uuid.uuid4().hex
    project = f"p-{uuid.uuid4().hex[:6]}"
    assert store.create_many([(job_id, JobRequest(instance={"data_source": "shell"}))], project=project,
                             needs=[3]) == [True]
    from prorl_celery import keys

    assert store.admit(job_id, JobStatus.INIT, "w", "t", 5000).admitted
    assert store.redis.get(keys.project_sandboxes(project)) == b"3"
    assert store.redis.hget(keys.job(job_id), "sandboxes_held") == b"3"
    assert store.counts(project)["init"] == 1 and store.counts(project)["queued"] == 0
