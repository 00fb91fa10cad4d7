"""The completion long poll's linger: once the first completion has come, a read gathers others
for that long, within its wait and its count (prorl_celery/completions.py, ``GET /completions``)."""
from __future__ import annotations

import threading
import time
import uuid

import pytest

from prorl_celery import completions, keys
from prorl_celery.jobs import JobStore

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)


@pytest.fixture
def store(scratch_redis):
    return JobStore(scratch_redis, job_ttl_s=60)


def _finish(store: JobStore, group: str, job_id: str, project: str = "") -> None:
    """A completion entry as a terminal change writes it (its job record is not needed here)."""
    store.redis.xadd(keys.group_completions(group), {"job_id": job_id, "status": "completed",
                                                     "group_id": group, "project": project})


def _later(seconds: float, *work) -> threading.Thread:
    def run():
        time.sleep(seconds)
        for call in work:
            call()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_read_that_lingers_takes_what_ends_meanwhile(store):
    group = uuid.uuid4().hex
    _finish(store, group, "a")
    late = _later(0.3, lambda: _finish(store, group, "b"))
    items, cursor = completions.read(store, None, wait_s=10, group_id=group, linger_s=1.5)
    late.join()
    assert [i["job_id"] for i in items] == ["a", "b"]
    assert cursor == items[-1]["cursor"]
    # without a linger the same read answers with what had come: the next read has the rest
    group = uuid.uuid4().hex
    _finish(store, group, "a")
    late = _later(0.3, lambda: _finish(store, group, "b"))
    items, cursor = completions.read(store, None, wait_s=10, group_id=group)
    assert [i["job_id"] for i in items] == ["a"]
    late.join()
    rest, _ = completions.read(store, cursor, wait_s=10, group_id=group)
    assert [i["job_id"] for i in rest] == ["b"]


def test_the_linger_starts_at_the_first_completion_and_ends_within_the_wait(store):
    group = uuid.uuid4().hex
    late = _later(0.4, lambda: _finish(store, group, "a"))
    start = time.monotonic()
    items, _ = completions.read(store, None, wait_s=10, group_id=group, linger_s=0.6)
    took = time.monotonic() - start
    late.join()
    assert [i["job_id"] for i in items] == ["a"]
    assert took >= 1.0  # 0.4 s for the first, then the whole linger
    _finish(store, group, "b")
    start = time.monotonic()  # a linger longer than what is left of the wait stops at the wait
    completions.read(store, None, wait_s=0.3, group_id=group, linger_s=5)
    assert time.monotonic() - start < 3


def test_a_read_that_has_its_count_does_not_linger(store):
    group = uuid.uuid4().hex
    for job_id in "abc":
        _finish(store, group, job_id)
    start = time.monotonic()
    items, cursor = completions.read(store, None, wait_s=10, group_id=group, count=2, linger_s=5)
    assert time.monotonic() - start < 3
    assert [i["job_id"] for i in items] == ["a", "b"]
    items, _ = completions.read(store, cursor, wait_s=10, group_id=group, count=1, linger_s=5)
    assert [i["job_id"] for i in items] == ["c"]


def test_what_the_linger_gathers_is_still_the_callers_own(store):
    group = uuid.uuid4().hex
    _finish(store, group, "mine-1", project="p")
    late = _later(0.2, lambda: _finish(store, group, "theirs", project="q"), lambda: _finish(store, group, "mine-2", project="p"))
    items, cursor = completions.read(store, None, wait_s=10, group_id=group, project="p", linger_s=1.0)
    late.join()
    assert [i["job_id"] for i in items] == ["mine-1", "mine-2"]
    assert cursor == items[-1]["cursor"]
