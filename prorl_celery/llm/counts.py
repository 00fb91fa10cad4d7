"""The router's counters of each backend (``registry.COUNTERS``: served, failures, consecutive
failures, measured seconds per turn), gathered in this process and written at most every
``FLUSH_S``: one script call per process and second, not one per release.

A release was a second script call per turn (~17,000 instructions on the routing's Redis before
it did anything) that read and wrote the backend's hash only to count the call and fold its
latency into the EWMA of ``turn_s`` (bench/RESULTS.md). Now the release is plain pipelined
``ZREM`` s of its leases (:mod:`prorl_celery.llm.routing`) and the outcomes wait here: per
backend, the calls served and failed, whether an ``ok`` came since the last write (the
consecutive failures then restart from those after it), and the EWMA of the samples as the
affine map ``old -> a x old + b`` (and its value from the first sample, for a backend not yet
measured): the same figures, in the same order, as one write per sample gave.

What that changes: the registry's counters and ``turn_s`` lag this process's calls by up to
``FLUSH_S`` (one thread per process writes them; a failure at once, with its release); a process that
exits drops its last second of them, as a crash of the routing's Redis (``appendfsync everysec``)
would. ``turn_s`` steers where new rollouts go, and one second of a 16 s turn's samples moves it
by nothing a router could act on; the counters are metrics. A forked child starts with none.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import redis

from prorl_celery import keys
from prorl_celery.redisio import LuaScript

log = logging.getLogger(__name__)

FLUSH_S = 1.0
EWMA_W = 0.2  # weight of the newest latency sample in a backend's measured seconds per turn

# KEYS: backends' hashes; ARGV per backend, in turn: served, failures, '1' if an ok came (the
# consecutive failures restart from the next value), failures since, the EWMA's a and b, its
# value from the first sample ('' if no sample). A backend no longer registered is left alone.
_COUNTS = """
for i, key in ipairs(KEYS) do
  local o = (i - 1) * 7
  local f = redis.call('HMGET', key, 'id', 'served', 'failures', 'consecutive_failures', 'turn_s')
  if f[1] then
    local since = tonumber(ARGV[o + 4])
    local run = ARGV[o + 3] == '1' and since or (tonumber(f[4]) or 0) + since
    local turn, old = f[5], tonumber(f[5])
    if ARGV[o + 7] ~= '' then
      turn = old and old * tonumber(ARGV[o + 5]) + tonumber(ARGV[o + 6]) or tonumber(ARGV[o + 7])
    end
    local served, failures = (tonumber(f[2]) or 0) + tonumber(ARGV[o + 1]), (tonumber(f[3]) or 0) + tonumber(ARGV[o + 2])
    if turn then
      redis.call('HSET', key, 'served', served, 'failures', failures, 'consecutive_failures', run, 'turn_s', turn)
    else
      redis.call('HSET', key, 'served', served, 'failures', failures, 'consecutive_failures', run)
    end
  end
end
return #KEYS
"""


@dataclass
class Tally:
    """One backend's outcomes since the last write."""

    served: int = 0
    failures: int = 0
    reset: bool = False  # an ok came: the consecutive failures are ``since`` alone
    since: int = 0       # failures after the last ok (all of them if none)
    a: float = 1.0       # the EWMA of the samples: old -> a x old + b
    b: float = 0.0
    first: float | None = None  # the EWMA started from the first sample (a backend not yet measured)

    def ok(self, sample: float) -> None:
        self.served, self.reset, self.since = self.served + 1, True, 0
        self.a, self.b = self.a * (1 - EWMA_W), self.b * (1 - EWMA_W) + EWMA_W * sample
        self.first = sample if self.first is None else self.first + EWMA_W * (sample - self.first)

    def failed(self) -> None:
        self.failures, self.since = self.failures + 1, self.since + 1

    def argv(self) -> list:
        return [self.served, self.failures, int(self.reset), self.since, repr(self.a), repr(self.b),
                "" if self.first is None else repr(self.first)]


_COUNTS_SCRIPT = LuaScript(_COUNTS)


class Counts:
    """This process's tallies, per routing Redis (its address), written by one thread of its own
    (started at the first tally): it waits for a tally, lets ``FLUSH_S`` of them gather, writes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: dict[tuple, tuple[redis.Redis, dict[str, Tally]]] = {}
        self.due = threading.Event()  # set while tallies wait
        self.writer: threading.Thread | None = None

    def add(self, client: redis.Redis, where: tuple, backend_id: str, outcome: str, sample: float) -> None:
        """An outcome (ok with its seconds per turn per session, or failed), written within ``FLUSH_S``."""
        with self.lock:
            tally = self.pending.setdefault(where, (client, {}))[1].setdefault(backend_id, Tally())
            tally.ok(sample) if outcome == "ok" else tally.failed()
            if self.writer is None:
                self.writer = threading.Thread(target=self._write_on, name="llm-counts", daemon=True)
                self.writer.start()
        self.due.set()

    def _write_on(self) -> None:
        while True:
            self.due.wait()
            time.sleep(FLUSH_S)  # a second's tallies become one write
            self.due.clear()  # before the take: a tally added after it sets it again
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the writer must outlive one bad write
                log.exception("writing the LLM counters failed")

    def take(self, where: tuple | None = None) -> list[tuple[redis.Redis, dict[str, Tally]]]:
        with self.lock:
            if where is None:
                taken, self.pending = list(self.pending.values()), {}
            else:
                taken = [self.pending.pop(where)] if where in self.pending else []
        return taken

    def flush(self, where: tuple | None = None) -> int:
        """Write the tallies now (of the Redis at ``where``, or all): one script call per Redis;
        returns the backends written. A write that fails is logged: those counts are lost, as the
        leases they came with would lapse."""
        written = 0
        for client, tallies in self.take(where):
            ids = list(tallies)
            try:  # by digest (whole to a Redis that lost its scripts)
                _COUNTS_SCRIPT(client, [keys.llm_backend(bid) for bid in ids], [v for bid in ids for v in tallies[bid].argv()])
                written += len(ids)
            except redis.RedisError as exc:
                log.warning("writing the LLM counters of %d backends failed: %s", len(ids), exc)
        return written


COUNTS = Counts()


def _forget() -> None:
    """A forked child writes only its own calls (the parent's lock and writer thread are not its own)."""
    global COUNTS
    COUNTS = Counts()


os.register_at_fork(after_in_child=_forget)
