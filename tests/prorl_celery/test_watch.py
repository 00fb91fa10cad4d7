"""Statuses of many jobs read together (prorl_celery.watch) against the session's Redis."""
from __future__ import annotations

import time
import uuid

from prorl_celery.jobs import JobStore
from prorl_celery.models import JobRequest
from prorl_celery.status import JobStatus
from prorl_celery.watch import StatusWatch


def _jobs(store: JobStore, n: int) -> list[str]:
    named = [(uuid.uuid4().hex, JobRequest(instance={"data_source": "shell", "command": "true"}))
             for _ in range(n)]
    assert all(store.create_many(named))
    return [job_id for job_id, _ in named]


def _recorded(store: JobStore) -> list:
    """Every reading the watch makes of ``store`` from now on: (ids added, ids removed) each."""
    reads: list = []
    real = store.watched_statuses
    store.watched_statuses = lambda key, add, remove: reads.append((list(add), list(remove))) or real(key, add, remove)
    return reads


def test_statuses_reads_each_job_and_none_for_unknown(redis_client):
    store = JobStore(redis_client)
    ids = _jobs(store, 3)
    store.transition(ids[1], JobStatus.CANCELLED)
    assert store.statuses([*ids, "no-such-job"]) == [JobStatus.QUEUED, JobStatus.CANCELLED, JobStatus.QUEUED, None]
    assert store.statuses([]) == []


def test_one_reading_answers_every_watched_job_until_it_is_old(redis_client):
    store = JobStore(redis_client)
    ids = _jobs(store, 20)
    watch = StatusWatch(store, max_age_s=1.5, forget_s=10.0)
    reads = _recorded(store)
    assert [watch.status(j) for j in ids] == [JobStatus.QUEUED] * 20
    before = len(reads)
    assert [watch.status(j) for j in ids] == [JobStatus.QUEUED] * 20
    assert len(reads) == before  # polled again: answered from the readings
    store.transition(ids[5], JobStatus.CANCELLED)  # as a cancel elsewhere does
    deadline = time.monotonic() + 3.0
    while watch.status(ids[5]) is not JobStatus.CANCELLED:
        assert time.monotonic() < deadline, "the cancel was not seen within max_age_s"
        time.sleep(0.05)
    assert len(reads) == before + 1 and sorted(reads[-1][0]) == sorted(ids)  # one reading covered them all
    assert watch.status(ids[0]) is JobStatus.QUEUED and len(reads) == before + 1


def test_readings_send_only_the_ids_that_joined_or_left(redis_client):
    """The watched ids live in Redis: a reading sends what changed, not every job's key; a job
    nobody asks about leaves the set; a set that lapsed is filled again."""
    store = JobStore(redis_client)
    ids = _jobs(store, 5)
    watch = StatusWatch(store, max_age_s=0.0, forget_s=0.5)
    reads = _recorded(store)
    for j in ids:
        watch.status(j)  # first asked: read alone
    assert [watch.status(j) for j in ids] == [JobStatus.QUEUED] * 5
    assert sorted(reads[0][0]) == sorted(ids) and reads[0][1] == []
    assert all(add == [] and remove == [] for add, remove in reads[1:])  # nothing sent again
    assert {m.decode() for m in redis_client.smembers(watch.key)} == set(ids)
    assert 0 < redis_client.ttl(watch.key) <= 60
    store.transition(ids[2], JobStatus.CANCELLED)
    assert watch.status(ids[2]) is JobStatus.CANCELLED
    time.sleep(0.6)
    reads.clear()
    assert watch.status(ids[0]) is JobStatus.QUEUED  # the others were forgotten: they leave the set
    assert any(sorted(remove) == sorted(ids[1:]) for _, remove in reads), reads
    assert {m.decode() for m in redis_client.smembers(watch.key)} == {ids[0]}
    redis_client.delete(watch.key)  # as if the set lapsed
    store.transition(ids[0], JobStatus.CANCELLED)
    assert watch.status(ids[0]) is JobStatus.CANCELLED
    assert {m.decode() for m in redis_client.smembers(watch.key)} == {ids[0]}


def test_a_reading_returns_only_what_changed(redis_client):
    """A reading is O(changes): every status change names its job in the changed-set of each watch
    that reads it; a job that ends leaves no watchers behind."""
    store = JobStore(redis_client)
    ids = _jobs(store, 6)
    watch = StatusWatch(store, max_age_s=0.0, forget_s=10.0)
    for j in ids:
        watch.status(j)
    watch.status(ids[0])  # the reading that adds them all
    assert store.watched_statuses(watch.key, [], []) == (6, {})  # nothing changed: nothing read
    store.transition(ids[3], JobStatus.CANCELLED)
    assert store.watched_statuses(watch.key, [], []) == (6, {ids[3]: JobStatus.CANCELLED})
    assert store.watched_statuses(watch.key, [], []) == (6, {})
    assert not redis_client.exists(f"prorl:job:{ids[3]}:watchers")  # terminal: its watchers forgotten
    store.transition(ids[4], JobStatus.CANCELLED)
    assert watch.status(ids[4]) is JobStatus.CANCELLED and watch.status(ids[5]) is JobStatus.QUEUED
    other = StatusWatch(store, max_age_s=0.0, forget_s=10.0)  # two watches of one job: both told
    other.status(ids[5]), other.status(ids[5])
    store.transition(ids[5], JobStatus.CANCELLED)
    assert other.status(ids[5]) is JobStatus.CANCELLED and watch.status(ids[5]) is JobStatus.CANCELLED
