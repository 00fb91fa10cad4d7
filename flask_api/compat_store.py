"""What the reference-compatible endpoints remember between requests: whether ``/start`` was
called, which jobs ``/process`` started (so that ``/stop`` can cancel them), and which of them run
under each ``job_id`` label (so that ``/cancel {job_id}`` reaches every one, and says how the last
one ended once none runs). Shared by every API process through Redis; each project has its own
(its ``/start``, ``/stop`` and labels reach no other project's), the operator's token the one from
before projects."""
from __future__ import annotations

import redis

from prorl_celery import keys
from prorl_celery.redisio import text

LABEL_TTL_S = 7 * 86400  # as long as a job record is kept


class CompatState:
    def __init__(self, client: redis.Redis, project: str | None = None):
        self.redis, self.project = client, project

    def start(self) -> bool:
        """Start accepting ``/process``; False when it already was."""
        return bool(self.redis.set(keys.compat_running(self.project), "1", nx=True))

    def running(self) -> bool:
        return bool(self.redis.get(keys.compat_running(self.project)))

    def track(self, job_id: str, label: str | None = None) -> None:
        """A job ``/process`` started (under the client's ``label``, if it gave one) and waits for."""
        pipe = self.redis.pipeline()
        pipe.sadd(keys.compat_jobs(self.project), job_id)
        if label:
            pipe.sadd(keys.compat_label(label, self.project), job_id)
            pipe.expire(keys.compat_label(label, self.project), LABEL_TTL_S)
            pipe.set(keys.compat_label_last(label, self.project), job_id, ex=LABEL_TTL_S)
        pipe.execute()

    def untrack(self, job_id: str, label: str | None = None) -> None:
        pipe = self.redis.pipeline()
        pipe.srem(keys.compat_jobs(self.project), job_id)
        if label:
            pipe.srem(keys.compat_label(label, self.project), job_id)
        pipe.execute()

    def runs(self, label: str) -> tuple[list[str], str | None]:
        """The jobs running under ``label`` and the one last started under it (None: never, or
        longer ago than the label is remembered)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(keys.compat_label(label, self.project))
        pipe.get(keys.compat_label_last(label, self.project))
        live, last = pipe.execute()
        return sorted(text(x) for x in live), text(last) if last else None

    def stop(self) -> list[str]:
        """Stop accepting ``/process``; the ids of the jobs it started that are not yet answered,
        forgotten as they are returned."""
        pipe = self.redis.pipeline()
        pipe.delete(keys.compat_running(self.project))
        pipe.smembers(keys.compat_jobs(self.project))
        pipe.delete(keys.compat_jobs(self.project))
        _, ids, _ = pipe.execute()
        return sorted(text(x) for x in ids)
