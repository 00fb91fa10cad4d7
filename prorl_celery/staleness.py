"""Weight versions in order, and the staleness bound of asynchronous RL (AReaL's rule).

Versions are names the trainer gives (``"step12"``); each gets an ordinal the first time it is
seen (1, 2, ...), and ``current`` is the ordinal of the version the trainer resumed with last
(``POST /llm_servers/resume {"weight_version"}``). Staleness counts ordinals.

**Admission** (``max_staleness`` = k): a rollout starts only while ``current - oldest <= k``,
``oldest`` being the version that was current when the oldest *unconsumed* rollout was admitted.
Otherwise it waits (queued in its run stage, not refused) until the trainer consumes that result.
**Consumed** means acknowledged: the trainer calls ``POST /jobs/ack {"job_ids"}`` (the SDK's
``ack``) once it has read a result into a batch; a job that ends without a result to train on
(failed, cancelled, timeout) is consumed when it ends. Only rollouts with a bound are tracked.

Each project (``prorl_celery.projects``) has versions, a current one and unconsumed rollouts of its
own: one RL run's resume never holds back another's rollouts.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.errors import PolicyDenied

NO_BOUND = object()  # a job that names no max_staleness (an explicit null is a request for no bound)


def check_max_staleness(sampling_params: dict[str, Any], field: str = "sampling_params.max_staleness") -> None:
    """A job's ``max_staleness`` may only narrow the operator's ``PRORL_MAX_STALENESS``: with an
    operator bound k, a job's null (no bound) or a value above k is refused (PolicyDenied, 403,
    naming ``field``) at submission, not silently clamped, so a trainer learns the bound it runs
    under. A job that names none takes the operator's."""
    limit = get_settings().max_staleness
    asked = sampling_params.get("max_staleness", NO_BOUND)
    if limit is None or asked is NO_BOUND or (asked is not None and asked <= limit):
        return
    raise PolicyDenied(f"max_staleness {'null (no bound)' if asked is None else asked} would widen the operator's "
                       f"bound of {limit} versions (PRORL_MAX_STALENESS): a job may only ask for at most {limit}",
                       field=field)


def effective_max_staleness(sampling_params: dict[str, Any]) -> int | None:
    """The bound a job runs under: its own if it names one, the operator's if that is tighter or
    the job names none (a job stored before the operator lowered the bound still only narrows)."""
    limit = get_settings().max_staleness
    asked = sampling_params.get("max_staleness", limit)
    if asked is None or limit is None:
        return limit if asked is None else asked
    return min(asked, limit)

_ADVANCE = """
local o = redis.call('HGET', KEYS[1], ARGV[1])
if not o then
  o = redis.call('HLEN', KEYS[1]) + 1
  redis.call('HSET', KEYS[1], ARGV[1], o)
end
if ARGV[2] == '1' then redis.call('SET', KEYS[2], o) else redis.call('SETNX', KEYS[2], o) end
return tonumber(o)
"""
# 1: admitted now or already; 0: held. ARGV: job id, k.
_ADMIT = """
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 1 end
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if oldest[2] and current - tonumber(oldest[2]) > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[2], current, ARGV[1])
return 1
"""


class WeightVersions:
    """One project's weight versions (None: the operator's): each RL run's trainer resumes its
    own backends with its own versions, and its rollouts' staleness counts only those."""

    def __init__(self, client: redis.Redis, project: str | None = None):
        self.redis, self.project = client, project or None
        self._advance = client.register_script(_ADVANCE)
        self._admit = client.register_script(_ADMIT)

    def _names(self) -> list[str]:
        return [keys.weight_versions(self.project), keys.weight_current(self.project)]

    def advance(self, name: str) -> int:
        """The trainer resumed with ``name``: it is the current version now. Returns its ordinal."""
        return int(self._advance(keys=self._names(), args=[name, 1]))

    def know(self, name: str) -> int:
        """``name`` exists (a backend registered with it); current only if nothing is yet."""
        return int(self._advance(keys=self._names(), args=[name, 0]))

    def current(self) -> int:
        return int(self.redis.get(keys.weight_current(self.project)) or 0)

    def ordinals(self, names: Iterable[str | None]) -> dict[str, int]:
        """The ordinal of each known name (unknown ones and None are left out)."""
        wanted = sorted({n for n in names if n})
        if not wanted:
            return {}
        found = self.redis.hmget(keys.weight_versions(self.project), wanted)
        return {name: int(o) for name, o in zip(wanted, found) if o is not None}

    # -- admission --------------------------------------------------------------------------
    def admit(self, job_id: str, k: int) -> bool:
        """Admit the rollout unless the trainer is more than ``k`` versions ahead of the oldest
        unconsumed result; an admitted rollout stays unconsumed until :meth:`consume`."""
        return bool(self._admit(keys=[keys.weight_current(self.project), keys.weight_unconsumed(self.project)],
                                args=[job_id, k]))

    def consume(self, job_ids: Iterable[str]) -> int:
        ids = list(job_ids)
        return int(self.redis.zrem(keys.weight_unconsumed(self.project), *ids)) if ids else 0

    def oldest_unconsumed(self) -> int | None:
        oldest = self.redis.zrange(keys.weight_unconsumed(self.project), 0, 0, withscores=True)
        return int(oldest[0][1]) if oldest else None

    def unconsumed(self) -> int:
        return int(self.redis.zcard(keys.weight_unconsumed(self.project)))
