"""The statuses of the jobs a process is running, read together.

A running stage polls its job's status to notice a cancel or a requeue elsewhere (the LLM call
monitor asks every call's ``should_stop()`` four times a second). One Redis round trip per poll
per job made that the largest part of a run worker's Redis traffic; here the statuses of every
job asked about lately are read in one script call, at most once per ``max_age_s``, and each
poll is answered from that reading. The watched ids live in a Redis set of the watch's own, so
a reading sends only the ids that joined or left it (sending every watched job's key, four
times a second for the hours a batch of long rollouts runs, was most of what a run worker sent
Redis besides the rollouts themselves); and every status change names its job in the changed-set
of each watch that reads it (``keys.job_watchers``), so a reading returns only what changed:
one command and O(changes), not a read of every watched job five times a second.
"""
from __future__ import annotations

import threading
import time
import uuid
import weakref

from prorl_celery import keys

from prorl_celery.jobs import JobStore
from prorl_celery.status import JobStatus

MAX_AGE_S = 0.2
"""A status read longer ago than this is read again (with every other watched job's)."""
FORGET_S = 1.0
"""A job nobody asked about for this long is no longer read."""


class StatusWatch:
    def __init__(self, store: JobStore, max_age_s: float = MAX_AGE_S, forget_s: float = FORGET_S):
        self.store, self.max_age_s, self.forget_s = store, max_age_s, forget_s
        self._asked: dict[str, float] = {}
        self._known: dict[str, tuple[float, JobStatus | None]] = {}
        self._lock = threading.Lock()
        self._reading = threading.Lock()
        self.key = keys.status_watch(uuid.uuid4().hex)
        self._in_set: set[str] = set()  # what the Redis set held at the last reading

    def status(self, job_id: str) -> JobStatus | None:
        """The job's status as read at most ``max_age_s`` ago (a job asked about for the first
        time, or again after ``forget_s``, is read alone)."""
        now = time.monotonic()
        with self._lock:
            self._asked[job_id] = now
            entry = self._known.get(job_id)
        if entry is None:
            status = self.store.status(job_id)
            with self._lock:
                self._known[job_id] = (now, status)
            return status
        if now - entry[0] < self.max_age_s:
            return entry[1]
        with self._reading:  # one reading at a time; a thread that waited finds it fresh
            with self._lock:
                entry = self._known.get(job_id)
            if entry is None or time.monotonic() - entry[0] >= self.max_age_s:
                self._read_all()
                with self._lock:
                    entry = self._known.get(job_id)
        return entry[1] if entry else self.store.status(job_id)

    def _read_all(self) -> None:
        started = time.monotonic()
        with self._lock:
            for job_id in [j for j, t in self._asked.items() if started - t > self.forget_s]:
                del self._asked[job_id]
                self._known.pop(job_id, None)
            ids = set(self._asked)
        size, read = self.store.watched_statuses(self.key, sorted(ids - self._in_set), sorted(self._in_set - ids))
        if size != len(ids):  # the set lapsed (a reading more than its ttl after the last): read them all
            size, more = self.store.watched_statuses(self.key, sorted(ids), [])
            read.update(more)
        self._in_set = ids
        with self._lock:  # a job not in the reading kept its status: known as of now
            for job_id in ids:
                if job_id in read:
                    self._known[job_id] = (started, read[job_id])
                elif job_id in self._known:
                    self._known[job_id] = (started, self._known[job_id][1])


_watches: weakref.WeakKeyDictionary[JobStore, StatusWatch] = weakref.WeakKeyDictionary()
_watches_lock = threading.Lock()


def watch(store: JobStore) -> StatusWatch:
    """The process's watch over ``store``'s jobs."""
    with _watches_lock:
        found = _watches.get(store)
        if found is None:
            found = _watches[store] = StatusWatch(store)
        return found
