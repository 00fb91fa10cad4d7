"""Where the LLM routing keeps its state: the head's Redis, or a Redis of its own (``routing_url``).

The routing writes twice per turn (the acquire's lease and session, the release's counters). On
the head's Redis, which persists with ``appendfsync always`` (job records, the broker), each of
those writes ends in an fsync of its own: about 150 µs of the head's ~360 per turn
(bench/RESULTS.md). What the routing keeps lapses by design (a lease in ``llm_lease_s``, a session
in ``llm_session_idle_s``, stickiness in hours, the hour's tokens in an hour), so a Redis of its own
persisted with ``appendfsync everysec`` holds it: a crash there loses at most its last second,
i.e. leases that lapse anyway, a turn's speed sample, a few tokens of a project's hour.

What lives there, all of it (one Lua script touches only the keys of one Redis, and the acquire
reads the registry, the leases, sessions and stickiness and the project's counters together):

- the backend registry (``keys.llm_backends``, each backend's hash: status, capacity, speed,
  counters, pause) — the acquire decides on it and the release writes its counters; registrations
  are idempotent (``POST /llm_servers`` of the same address again), which is how one lost in a
  crash of the routing Redis comes back;
- each backend's in-flight leases and sessions, each rollout's stickiness;
- each project's LLM requests in flight and tokens of the hour (:mod:`prorl_celery.quotas`).

What stays on the head and is read from there: the job's project (once per rollout and process:
it never changes) and the projects' records (quotas, weight; read again at most every
``PROJECTS_TTL_S`` by each process, at once by the one that changed them). Fair share's admission
reads a project's LLM counters from here before its script runs on the head (a separate read: the
refusal at ``over: 429`` is a heuristic against a count that moves every turn anyway).

Unset, the head's Redis holds all of it, exactly as before: the scripts read the job's project and
the projects' records themselves.
"""
from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict

import redis

from config.settings import get_settings
from prorl_celery import keys

PROJECTS_TTL_S = 1.0  # how stale a process's copy of the projects' quotas and weights may be
JOBS_KEPT = 65536  # the jobs whose project a process remembers (a rollout's turns ask it each)


def routing_redis(head: redis.Redis) -> redis.Redis:
    """The Redis that holds the routing's state for a service whose head is ``head``."""
    url = get_settings().routing_url
    return _client(url) if url else head


@functools.cache
def _client(url: str) -> redis.Redis:
    from prorl_celery.connections import _client as make

    return make(url)


def llm_in_flight(head: redis.Redis, projects: list[str]) -> list[int]:
    """Each project's LLM requests in flight now (on the routing's Redis), in one round trip."""
    pipe = routing_redis(head).pipeline(transaction=False)
    now_ms = int(time.time() * 1000)
    for name in projects:
        pipe.zcount(keys.llm_project_inflight(name), now_ms, "+inf")
    return [int(n) for n in pipe.execute()] if projects else []


def forget_clients() -> None:
    """A forked stage worker makes its own (smaller) pool, as it does for the head's."""
    _client.cache_clear()


class HeadView:
    """What the routing reads from the head when its own state lives elsewhere: a job's project
    and the projects' quotas and weights, cached in this process."""

    _lock = threading.Lock()
    _projects: dict[tuple, tuple[float, tuple[dict[str, str], str]]] = {}
    _jobs: OrderedDict[str, str] = OrderedDict()

    def __init__(self, head: redis.Redis):
        self.head = head
        where = head.connection_pool.connection_kwargs
        self._where = tuple(where.get(k) for k in ("host", "port", "path", "db"))  # the projects' copy is per Redis

    def project_of(self, job_id: str) -> str:
        """The job's project ('' for the operator's jobs or an unknown job)."""
        with self._lock:
            found = self._jobs.get(job_id)
        if found is not None:
            return found
        status, project = self.head.hmget(keys.job(job_id), "status", "project")
        name = project.decode() if project else ""
        if status is not None:  # a stored job's project never changes
            with self._lock:
                self._jobs[job_id] = name
                while len(self._jobs) > JOBS_KEPT:
                    self._jobs.popitem(last=False)
        return name

    def projects(self) -> tuple[dict[str, str], str]:
        """Every project's record (quotas, weight) as stored, and their weights as one JSON object;
        read again after ``PROJECTS_TTL_S``."""
        with self._lock:
            at, found = self._projects.get(self._where, (0.0, ({}, "{}")))
        if time.monotonic() - at < PROJECTS_TTL_S:
            return found
        raw = {name.decode(): record.decode() for name, record in self.head.hgetall(keys.projects()).items()}
        found = raw, json.dumps({name: json.loads(record).get("weight") for name, record in raw.items()})
        with self._lock:
            self._projects[self._where] = (time.monotonic(), found)
        return found

    @classmethod
    def changed(cls) -> None:
        """A project's record was written by this process: read them again on the next call."""
        with cls._lock:
            cls._projects.clear()
