"""What the reference-compatible endpoints remember between requests: whether ``/start`` was
called, and which jobs ``/process`` started (so that ``/stop`` can cancel them). Shared by every
API process through Redis."""
from __future__ import annotations

import redis

from prorl_celery import keys


class CompatState:
    def __init__(self, client: redis.Redis):
        self.redis = client

    def start(self) -> bool:
        """Start accepting ``/process``; False when it already was."""
        return bool(self.redis.set(keys.compat_running(), "1", nx=True))

    def running(self) -> bool:
        return bool(self.redis.get(keys.compat_running()))

    def track(self, job_id: str) -> None:
        """A job ``/process`` started and is waiting for."""
        self.redis.sadd(keys.compat_jobs(), job_id)

    def untrack(self, job_id: str) -> None:
        self.redis.srem(keys.compat_jobs(), job_id)

    def stop(self) -> list[str]:
        """Stop accepting ``/process``; the ids of the jobs it started that are not yet answered,
        forgotten as they are returned."""
        pipe = self.redis.pipeline()
        pipe.delete(keys.compat_running())
        pipe.smembers(keys.compat_jobs())
        pipe.delete(keys.compat_jobs())
        _, ids, _ = pipe.execute()
        return sorted(x.decode() if isinstance(x, bytes) else x for x in ids)
