"""Where a rollout's records live: the head's Redis, or one of N store shards chosen by job id.

Everything that grows with turns — a rollout's call records and conversation (the two lists of
:mod:`prorl_celery.rollout.store`) — is the head's first load past a thousand rollouts: 4.7 kB
received and 3.6 kB held per turn (bench/RESULTS.md). Those lists can live on N Redis instances
of their own, ``PRORL_STORE_SHARDS=redis://a,redis://b``; the job records, the broker, the result
backend, fair share and LLM routing stay on the head's Redis. Unset: the head holds the lists too,
exactly as before (one Redis, the fenced save in one script).

A job's shard is ``crc32(job id) mod N``: stable across processes and restarts, so every writer
and reader of one rollout meets on the same instance. The shard list's order is its identity:
an operator adds shards only with an empty store (a rollout never moves).

One seam: :meth:`Shards.store_for` is how every reader and writer of the lists finds them
(:class:`~prorl_celery.rollout.store.RolloutStore`, the fenced save of
:meth:`~prorl_celery.jobs.JobStore.save_state`, the views, the cost reader). Reads of many rollouts
are grouped per shard (:meth:`Shards.by_store`): one round trip per shard, not per rollout.

The save, sharded, touches only the shard: one script appends the turn's records and writes the
stage's state beside them (its counts of calls and messages, the handler's keys), fenced by the
highest (attempt, stage) that saved there, so the counts a reader takes and the lists they count
never part, even when a shard on ``appendfsync everysec`` loses its last second. The head's record
is written when a stage begins and ends, not per turn: while a stage runs, the freshest state is
the shard's (:meth:`Shards.stage_states`; :meth:`prorl_celery.jobs.JobStore.get` reads it when the
head says the stage still runs in that attempt), and the stage's end, or the job's, writes the
state it ended with to the head. A cancel is not seen by the save: the stage notices it through
the status watch (:mod:`prorl_celery.watch`), and a save that lands after it stores records past
the counts the cancelled result holds, which every reader ignores.
"""
from __future__ import annotations

import zlib
import logging
from collections.abc import Callable, Iterable, Sequence

import redis

from prorl_celery import keys
from prorl_celery.errors import StoreLayoutMismatch
from prorl_celery.redisio import text

log = logging.getLogger(__name__)

# The writer's records and messages from given positions on (the transcript's, in memory).
Since = Callable[[int, int], tuple[list[bytes], list[str | bytes]]]

# KEYS: the rollout's calls list, messages list, its fence, its stage state. ARGV: 1 the writer's
# fence ((attempt, stage) as one number: :func:`fence_of`), 2 and 3 the calls and messages saved so
# far (its state's counts), 4 number n of new calls, 5 ttl (s), 6 the stage, 7 the attempt, 8 the
# state (JSON, with the new counts), then the n packed calls, then the new messages. A writer behind
# the fence is refused (0): it could otherwise trim what a later attempt or stage appended. A later
# one moves the fence. What lies past the saved counts (a stray write) is trimmed before the
# append. A list SHORTER than its saved count (a shard runs with ``appendfsync everysec``: a crash
# may lose the last second of saves) is not appended to: the reply is {-1, calls' length, messages'
# length}, nothing written, and the writer sends again from there (:meth:`Shards.save`).
SHARD_SAVE = """
local mine = tonumber(ARGV[1])
local fence = tonumber(redis.call('GET', KEYS[3]) or '0')
if mine < fence then return 0 end
local base, have = {tonumber(ARGV[2]), tonumber(ARGV[3])}, {0, 0}
for i = 1, 2 do
  if base[i] > 0 then have[i] = redis.call('LLEN', KEYS[i]) end
end
if have[1] < base[1] or have[2] < base[2] then return {-1, have[1], have[2]} end
if mine > fence then redis.call('SET', KEYS[3], ARGV[1]) end
local function extend(i, first, last)
  if base[i] == 0 then redis.call('DEL', KEYS[i])
  elseif have[i] > base[i] then redis.call('LTRIM', KEYS[i], 0, base[i] - 1) end
  for j = first, last, 4000 do redis.call('RPUSH', KEYS[i], unpack(ARGV, j, math.min(j + 3999, last))) end
end
local n = tonumber(ARGV[4])
extend(1, 9, 8 + n)
extend(2, 9 + n, #ARGV)
redis.call('HSET', KEYS[4], 'stage', ARGV[6], 'attempt', ARGV[7], 'state', ARGV[8])
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], tonumber(ARGV[5])) end
return 1
"""

_STAGE_ORDER = {"init": 1, "run": 2, "eval": 3}


def fence_of(attempt: int, stage: str) -> int:
    """A save's place in the job's life: later attempts, then later stages of one attempt, higher."""
    return 4 * attempt + _STAGE_ORDER.get(stage, 0)


# A shard's lists lapse this long after their last save beyond the job record's own ttl (which
# starts at the job's end, on the head): a job's end comes within its stage budgets of its last
# save, so its records outlive neither the other.
TTL_MARGIN_S = 86400


class ShardLostWrites(redis.exceptions.RedisError):
    """A shard holds fewer of a rollout's records than were saved and the writer cannot send them
    again: as any loss of the store, the stage stops and the sweep resumes it from what is stored."""


class Shards:
    """The head's Redis and the store shards (none: the head holds the rollouts)."""

    def __init__(self, head: redis.Redis, stores: Sequence[redis.Redis] = ()):
        self.head = head
        self.stores = list(stores)
        self._save = [s.register_script(SHARD_SAVE) for s in self.stores]

    @classmethod
    def of(cls, where: Shards | redis.Redis) -> Shards:
        """``where`` as shards: a bare Redis holds everything (one instance, as in tests)."""
        return where if isinstance(where, Shards) else cls(where)

    @property
    def sharded(self) -> bool:
        return bool(self.stores)

    def index(self, job_id: str) -> int:
        """The shard of ``job_id`` (0 when unsharded)."""
        return zlib.crc32(job_id.encode()) % len(self.stores) if self.stores else 0

    def store_for(self, job_id: str) -> redis.Redis:
        """The Redis that holds ``job_id``'s rollout."""
        return self.stores[self.index(job_id)] if self.stores else self.head

    def by_store(self, job_ids: Iterable[str]) -> list[tuple[redis.Redis, list[int]]]:
        """The positions of ``job_ids`` grouped by the Redis holding them (for one pipeline each)."""
        groups: dict[int, list[int]] = {}
        for i, job_id in enumerate(job_ids):
            groups.setdefault(self.index(job_id), []).append(i)
        return [(self.stores[k] if self.stores else self.head, positions) for k, positions in sorted(groups.items())]

    def check_layout(self) -> None:
        """Refuse a layout other than the store's: the head records how many shards it has and
        each shard its place, the first time a process looks; a later process with another
        count or order raises :class:`StoreLayoutMismatch` (its writes would land where no reader
        looks). Once the store holds no job, ``DEL prorl:store:layout`` on the head (and
        ``prorl:store:shard`` on each shard) lets a new layout be taken."""
        stored = _claim(self.head, keys.store_layout(), len(self.stores))
        if stored != len(self.stores):
            raise StoreLayoutMismatch(f"PRORL_STORE_SHARDS names {len(self.stores)} store shards; this head's "
                                      f"rollouts are spread over {stored} (see prorl_celery/shards.py)")
        for i, store in enumerate(self.stores):
            place = _claim(store, keys.store_shard_index(), i)
            if place != i:
                raise StoreLayoutMismatch(f"PRORL_STORE_SHARDS lists as shard {i + 1} the one started as "
                                          f"shard {place + 1}: keep the list's order")

    def save(self, job_id: str, stage: str, attempt: int, state: str, saved: dict[str, int], calls: list[bytes],
             messages: list[str | bytes], ttl_s: int, since: Since | None = None) -> bool:
        """A running stage's save, on the rollout's shard alone (see the module): append what the
        transcript gained past the ``saved`` counts and keep ``state`` (JSON) as the stage's; False:
        a later attempt or stage saved there.

        A list shorter than its saved count lost its tail in a crash of the shard (``appendfsync
        everysec``): ``since(calls, messages)`` gives the writer's records and messages from those
        positions on (it holds the whole rollout in memory), and the save sends them again from
        what the shard holds, so the lists end complete and in order. Without ``since`` it raises
        :class:`ShardLostWrites`: a Redis error, so the stage is resumed from what is stored."""
        k = self.index(job_id)
        names = [keys.rollout_calls(job_id), keys.rollout_messages(job_id), keys.rollout_fence(job_id),
                 keys.rollout_state(job_id)]
        base = [saved.get("calls", 0), saved.get("messages", 0)]
        for _ in range(2):
            reply = self._save[k](keys=names, args=[fence_of(attempt, stage), *base, len(calls),
                                                    ttl_s + TTL_MARGIN_S, stage, attempt, state, *calls, *messages])
            if not isinstance(reply, list):
                return bool(reply)
            have = [int(reply[1]), int(reply[2])]
            if since is None:
                raise ShardLostWrites(f"store shard {k + 1} holds {have} of job {job_id}'s calls and messages, "
                                       f"fewer than the {base} saved: it lost writes")
            log.warning("job %s: store shard %d held %s of the %s calls and messages saved (a crash lost "
                        "writes); sending them again", job_id, k + 1, have, base)
            base = [min(b, h) for b, h in zip(base, have)]
            calls, messages = since(*base)
        raise ShardLostWrites(f"store shard {k + 1} kept losing job {job_id}'s writes")

    def stage_states(self, jobs: Sequence[tuple[str, str, int]]) -> list[str | None]:
        """For each ``(job_id, stage, attempt)``: the state (JSON) the shard holds from that stage's
        saves in that attempt, None if its last save was another's (or none), in one round trip
        per shard."""
        found: dict[int, str | None] = {}
        for store, positions in self.by_store(job_id for job_id, _, _ in jobs):
            pipe = store.pipeline(transaction=False)
            for i in positions:
                pipe.hmget(keys.rollout_state(jobs[i][0]), "stage", "attempt", "state")
            for i, (stage, attempt, state) in zip(positions, pipe.execute()):
                same = stage is not None and text(stage) == jobs[i][1] and text(attempt) == str(jobs[i][2])
                found[i] = text(state) if same and state is not None else None
        return [found.get(i) for i in range(len(jobs))]


def _claim(client: redis.Redis, key: str, value: int) -> int:
    """``key``'s value, set to ``value`` if it had none."""
    client.set(key, value, nx=True)
    return int(client.get(key))


def parse_urls(value: str | None) -> list[str]:
    """``PRORL_STORE_SHARDS``: comma-separated Redis URLs ('' or None: no shards)."""
    return [u.strip() for u in (value or "").split(",") if u.strip()]
