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
    reads = []
    real = store.statuses
    store.statuses = lambda job_ids: reads.append(list(job_ids)) or real(job_ids)
    assert [watch.status(j) for j in ids] == [JobStatus.QUEUED] * 20
    before = len(reads)
    assert [watch.status(j) for j in ids] == [JobStatus.QUEUED] * 20
    assert len(reads) == before  # polled again: answered from the readings
    store.transition(ids[5], JobStatus.CANCELLED)  # as a cancel elsewhere does
    deadline = time.monotonic() + 3.0
    while watch.status(ids[5]) is not JobStatus.CANCELLED:
        assert time.monotonic() < deadline, "the cancel was not seen within max_age_s"
        time.sleep(0.05)
    assert len(reads) == before + 1 and set(reads[-1]) == set(ids)  # one reading covered them all
    assert watch.status(ids[0]) is JobStatus.QUEUED and len(reads) == before + 1
