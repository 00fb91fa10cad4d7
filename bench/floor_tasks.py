"""The least a rollout's stage must do, as plain Celery tasks: ``bench/overhead.py``'s floor rows.

A rollout service cannot do less than a bare chain plus, in each stage, knowing its job (one read
of the job's hash) and recording its progress (one write); a rollout that runs a command also
starts a process for it. :func:`stage` is that and nothing more: no API, no leases, no attempts,
no fair share, no histograms, no sandbox host, no isolation. What the service spends beyond these
rows is its own overhead over the same work done by hand.

The stack's workers import this module only when ``bench/overhead.py`` starts them (``--include``).
"""
from __future__ import annotations

import os
import subprocess
import time

import redis

from prorl_celery.celery_app import app

_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _client
    if _client is None:  # one pool for the worker's threads, made at the first task
        _client = redis.Redis.from_url(os.environ["PRORL_REDIS_URL"])
    return _client


def job_key(job_id: str) -> str:
    return f"bench-floor:{job_id}"


@app.task(name="bench.floor.stage", resultrepr_maxsize=96)
def stage(job_id: str, name: str, shell: bool = False) -> dict[str, str]:
    """One stage of a floor rollout: its job read, for ``run`` with ``shell`` a fresh
    ``bash -c true`` (the process a command needs at the least), its progress written."""
    client = _redis()
    if not client.hgetall(job_key(job_id)):
        raise LookupError(f"no job {job_id}")
    if shell and name == "run":
        subprocess.run(["/bin/bash", "-c", "true"], check=True, stdin=subprocess.DEVNULL)
    client.hset(job_key(job_id), mapping={"status": name, f"t_{name}": time.time()})
    return {"job_id": job_id, "stage": name}
