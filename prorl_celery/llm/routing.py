"""Choosing a backend for one request, atomically in Redis: session affinity priced by measured speed.

Each rollout (job id) is a *session* of the backend that served its last turn: that backend holds
its prompt's prefix in its cache, and the next prompt extends it. Per backend, Redis keeps the
in-flight leases, the live sessions (``keys.llm_sessions``; dropped when the rollout ends or after
``llm_session_idle_s``) and a measured speed: the EWMA of a turn's latency divided by the load it
met (``turn_s``, seconds per turn per session), updated for every successful release (by its
process, at most every second: :mod:`prorl_celery.llm.counts`).

One Lua script per acquire (leases and sessions counted by expiry with ``ZCOUNT``; the lapsed ones
removed by one acquire in ``1 / SWEEP_P``, which only bounds the sets' memory):

- a new rollout goes where its turn is predicted to finish first, ``(load + 1) x turn_s`` with
  load = max(sessions, in flight), among backends with a free batch slot (a new backend, with no
  sessions, is filled by new rollouts first); an unmeasured backend is guessed from the best
  measured one scaled by capacity;
- a rollout stays on its backend unless its turn would queue there beyond the batch capacity for
  longer than re-prefilling its prompt costs on a backend with a free slot
  (``llm_sticky_reprefill_turns`` x that backend's ``turn_s``): in a saturated pool, moving a
  rollout only adds prefill work, so it pays only against a queue;
- the chosen backend gets the request's lease and the session;
- a backend private to a project (``project`` in its hash) is a candidate only for that
  project's jobs (the job's ``project``, read in the same script); shared ones for every job;
- a project's quotas (:mod:`prorl_celery.quotas`) are checked in the same script: its requests in
  flight (their own leases, lapsing with them) and its tokens of the last 60 minutes (added by
  the release of each call);
- weighted share of the capacity: when no candidate backend has a free slot, a project's request
  would queue inside a backend; it does so only while the project holds less than its weight's
  share of the candidates' capacity (among the projects with requests in flight), else it waits
  for a free slot (``share``). A project alone is never held, and a free slot goes to whoever
  asks: nothing idles. The operator's own jobs are outside it.

**What an acquire reads: not every backend** (issue 37: a fleet of 100,000 rollouts has hundreds
of them, and a script that read each on every call cost ~50,000 instructions per backend):

- *the rollout's own backend, when it has a free slot* (load, its own session aside, below its
  capacity): chosen without reading any other. It is the choice the rules above make when every
  backend is read: the first pass finds a backend with a free slot, so no share is checked; a
  choice other than the sticky one is taken only if the sticky one's queue pays, and with
  load < capacity its in-flight count is below it too: nothing queues there. Quotas are checked first,
  as always;
- otherwise, with at most ``SCAN_ALL`` backends registered, every one (the rules above, exactly);
- above ``SCAN_ALL``: the rollout's backend and ``SAMPLE`` random ones (``SRANDMEMBER``; the
  "power of d choices": the least loaded of a few random bins keeps a pool balanced almost as
  well as the least loaded of all), and every one when none of those may serve the job (another
  project's, another protocol, draining): a project's private backend is still found among
  hundreds it may not use. The weighted share's capacity is then estimated from the random ones
  read (their candidates' capacity x registered / drawn: unbiased, exact for a fleet of alike
  backends) instead of summed over all: nothing for the registry to maintain, and the share is a
  heuristic against counts that move every turn anyway.

The reply names the chosen backend and its record's revision (:mod:`prorl_celery.llm.registry`);
it carries the record itself only when this process's copy is not of that revision (the acquire
is given the revisions of the copies this process holds): a record of ~20 fields read and sent on
every call was about a quarter of the routing's work on its Redis (bench/RESULTS.md). A rollout
this process routed before names only its copy of that rollout's backend (the list of every copy
grows with the pool). The copies leave out the router's counters (``registry.COUNTERS``).

A project's tokens of the hour (``keys.llm_project_tokens``: minute -> tokens) were summed whole by
every acquire, and the minutes never trimmed while the project kept calling: ~6,000 instructions
a minute held, 0.35 M a call after an hour, 6 M after a day. The acquire now reads this minute's
field and the sum of the others, kept in the fields ``0`` and ``1`` (its value and the minute it
was summed in: minutes long lapsed, so every reader of the hour skips them) and summed again,
with the lapsed minutes dropped, by the first acquire of each minute (a release that lands in a
minute already summed, from a process whose clock lags, counts from the next minute on).

The release is plain pipelined commands (its leases out of their sets, the tokens into the
project's hour); the scripts' constants and key prefixes are written into their text at
registration (``_written_in``), not sent as arguments with each call.
"""
from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.llm import counts
from prorl_celery.llm.models import Backend, BackendStatus, Protocol
from prorl_celery.llm.registry import COUNTERS, REV, parse_backend
from prorl_celery.llm.store import HeadView, routing_redis
from prorl_celery.llm.transport import HeldLease

log = logging.getLogger(__name__)

STICKY_TTL_S = 6 * 3600
# Share of acquires that also remove the lapsed leases and idle sessions they pass (every count
# reads only the live ones: ZCOUNT by expiry; the removal only bounds the sets' memory).
SWEEP_P = 1 / 16

# Written into the scripts' text at registration (Router): each argument of an EVALSHA costs the
# routing's Redis ~1,100 instructions, the same text nothing.
SCAN_ALL = 16  # at most this many registered backends: an acquire that is not the sticky's reads them all
SAMPLE = 4     # above it: the sticky backend and this many random ones ("power of d choices")

_ACQUIRE = """
-- $-names are written in at registration (Router); the times come as the strings Redis is given
local now, lease_until, token, want = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local job, idle_cut, sweep = ARGV[7], ARGV[8], ARGV[9] == '1'
local after_now, after_cut = '(' .. now, '(' .. idle_cut
-- the job's project and its quotas: given by the caller when the head's Redis holds them and
-- this one does not (prorl_celery/llm/store.py), else read here
local given = ARGV[13] == '1'
local mine
if given then mine = ARGV[14] else mine = (job ~= '' and redis.call('HGET', KEYS[3], 'project')) or '' end
local pin = ''
if mine ~= '' then  -- the project's quotas (prorl_celery/quotas.py): at one, the call waits
  local raw
  if given then raw = ARGV[15] ~= '' and ARGV[15] else raw = redis.call('HGET', KEYS[4], mine) end
  local q = (raw and cjson.decode(raw).quotas) or {}
  pin = $PIN .. mine
  if sweep then redis.call('ZREMRANGEBYSCORE', pin, '-inf', now) end
  if q.max_llm_in_flight and redis.call('ZCOUNT', pin, after_now, '+inf') >= q.max_llm_in_flight then
    return {'quota'}
  end
  if q.tokens_per_hour then  -- this minute's tokens, and the rest of the hour as summed once a minute
    local minute, tk = math.floor(tonumber(now) / 60000), $TOKENS .. mine
    local f = redis.call('HMGET', tk, tostring(minute), '0', '1')
    local used = tonumber(f[1]) or 0
    if f[2] and tonumber(f[3]) == minute then
      used = used + tonumber(f[2])
    else  -- fields 0 and 1 (minutes long past for every reader of the hour) keep the sum and its minute
      local past, lapsed, flat = 0, {}, redis.call('HGETALL', tk)
      for i = 1, #flat, 2 do
        local m = tonumber(flat[i])
        if m > minute - 60 and m ~= minute then past = past + tonumber(flat[i + 1])
        elseif m <= minute - 60 and m > 1 then table.insert(lapsed, flat[i]) end
      end
      for i = 1, #lapsed, 1000 do redis.call('HDEL', tk, unpack(lapsed, i, math.min(i + 999, #lapsed))) end
      if #flat > 0 then redis.call('HSET', tk, '0', past, '1', minute) end  -- (a key only the release makes: its expiry)
      used = used + past
    end
    if used >= q.tokens_per_hour then return {'quota'} end
  end
end
local ids, cap, inflight, load, turn, rev, per_slot = {}, {}, {}, {}, {}, {}, nil
local seen, known, cut = {draining = false, quarantined = false}, {}, nil
-- one backend read: is it a candidate (active, the protocol wanted, shared or the job's project's)?
-- If so, its load: max(its live sessions but the job's own, its requests in flight)
local function read(id, own)
  if known[id] ~= nil then return known[id] end
  local f = redis.call('HMGET', $BACKEND .. id, 'status', 'capacity', 'protocol', 'turn_s', 'project', 'rev')
  local owner = f[5] or ''
  local fits = f[1] and (want == '' or f[3] == want) and (owner == '' or owner == mine)
  known[id] = (fits and f[1] == 'active') or false
  if not known[id] then
    if fits then seen[f[1]] = true end
    return false
  end
  local ik, sk = $INFLIGHT .. id, $SESSIONS .. id
  if sweep then
    redis.call('ZREMRANGEBYSCORE', ik, '-inf', now)
    redis.call('ZREMRANGEBYSCORE', sk, '-inf', idle_cut)
  end
  local sessions
  if own then  -- the job's sticky backend: its session is refreshed now (as a choice of it would), then not counted
    redis.call('ZADD', sk, now, job)
    sessions = redis.call('ZCOUNT', sk, after_cut, '+inf') - 1
  else
    sessions = redis.call('ZCOUNT', sk, after_cut, '+inf')
    if job ~= '' then
      local at = redis.call('ZSCORE', sk, job)
      cut = cut or tonumber(idle_cut)
      if at and tonumber(at) > cut then sessions = sessions - 1 end
    end
  end
  local c = math.max(tonumber(f[2]) or 1, 1)
  table.insert(ids, id)
  cap[id], inflight[id] = c, redis.call('ZCOUNT', ik, after_now, '+inf')
  load[id] = math.max(sessions, inflight[id])
  turn[id], rev[id] = tonumber(f[4]), f[6]
  if turn[id] and (per_slot == nil or turn[id] * c < per_slot) then per_slot = turn[id] * c end
  return true
end
local sticky = job ~= '' and redis.call('GET', KEYS[2])
local chosen
if sticky and read(sticky, true) and load[sticky] < cap[sticky] then
  -- the sticky backend has a free slot: the scan of every backend would choose it too (pass 1 finds
  -- a backend with a free slot, so no share check; a choice other than the sticky one is taken only
  -- if the sticky one's queue pays, and with load < capacity nothing queues there)
  chosen = sticky
else
  local registered = redis.call('SCARD', KEYS[1])
  local total = nil  -- the candidates' capacity: summed, or estimated from a sample
  if registered > $SCAN_ALL then  -- the sticky one and a few random ones; all if none of those is a candidate
    local drawn, found, sum = redis.call('SRANDMEMBER', KEYS[1], $SAMPLE), 0, 0
    for _, id in ipairs(drawn) do
      if read(id, id == sticky) then found, sum = found + 1, sum + cap[id] end
    end
    if found > 0 then total = sum * registered / #drawn end
  end
  if total == nil then
    for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do read(id, id == sticky) end
  end
  if #ids == 0 then
    if seen.draining then return {'draining'} end
    if seen.quarantined then return {'quarantined'} end
    return {'none'}
  end
  table.sort(ids)
  for _, id in ipairs(ids) do turn[id] = turn[id] or (per_slot or 1) / cap[id] end
  local best, best_eta = {}, nil
  for pass = 1, 2 do  -- first among backends with a free slot, else among all
    for _, id in ipairs(ids) do
      if pass == 2 or load[id] < cap[id] then
        local eta = (load[id] + 1) * turn[id]
        if best_eta == nil or eta < best_eta * (1 - 1e-9) then
          best, best_eta = {id}, eta
        elseif eta <= best_eta * (1 + 1e-9) then
          table.insert(best, id)
        end
      end
    end
    if best_eta then break end
    if pin ~= '' then  -- every slot taken: past its weighted share a project waits, the others queue
      local wsum, wmine, nmine = 0, 1, 0
      if total == nil then
        total = 0
        for _, id in ipairs(ids) do total = total + cap[id] end
      end
      local weights = {}
      if given then weights = cjson.decode(ARGV[16]) else
        local flat = redis.call('HGETALL', KEYS[4])
        for i = 1, #flat, 2 do weights[flat[i]] = cjson.decode(flat[i + 1]).weight or 1 end
      end
      for name, weight in pairs(weights) do
        local n = redis.call('ZCOUNT', $PIN .. name, after_now, '+inf')
        if name == mine or n > 0 then
          local w = tonumber(weight) or 1
          wsum = wsum + w
          if name == mine then wmine, nmine = w, n end
        end
      end
      if wsum > wmine and nmine >= total * wmine / wsum then return {'share'} end
    end
  end
  chosen = #best == 1 and best[1] or best[math.min(math.floor(tonumber(ARGV[6]) * #best) + 1, #best)]
  if sticky and cap[sticky] and sticky ~= chosen then
    local queued = inflight[sticky] + 1 - cap[sticky]
    local pays = queued > 0 and inflight[chosen] < cap[chosen]
      and queued * turn[sticky] > tonumber(ARGV[5]) * turn[chosen]
    if not pays then chosen = sticky end
  end
end
if sticky and sticky ~= chosen then redis.call('ZREM', $SESSIONS .. sticky, job) end
redis.call('ZADD', $INFLIGHT .. chosen, lease_until, token)
if pin ~= '' then
  redis.call('ZADD', pin, lease_until, token)
  redis.call('PEXPIRE', pin, ARGV[10])
end
if job ~= '' and chosen ~= sticky then  -- (the sticky one's session: read() refreshed it)
  redis.call('ZADD', $SESSIONS .. chosen, now, job)
end
if job ~= '' and (chosen ~= sticky or ARGV[12] == '1') then  -- (its expiry: refreshed now and then, ARGV[12])
  redis.call('SET', KEYS[2], chosen, 'EX', $STICKY_TTL)
end
-- the record only if the caller's copy (ARGV[11]: ';id:rev;id:rev;', or of the job's last backend alone)
-- is not of its current revision
local reply = {'ok', chosen, tostring(load[chosen]), tostring(inflight[chosen] + 1), rev[chosen] or '', mine}
if not (rev[chosen] and string.find(ARGV[11], ';' .. chosen .. ':' .. rev[chosen] .. ';', 1, true)) then
  reply[7] = redis.call('HGETALL', $BACKEND .. chosen)
end
return reply
"""


def _written_in(script: str) -> str:
    """``script`` with its $-names as Lua literals: the key prefixes (keys.py) and the constants."""
    names = {"$BACKEND": keys.llm_backend(""), "$INFLIGHT": keys.llm_inflight(""),
             "$SESSIONS": keys.llm_sessions(""), "$PIN": keys.llm_project_inflight(""),
             "$TOKENS": keys.llm_project_tokens(""), "$SCAN_ALL": SCAN_ALL, "$SAMPLE": SAMPLE,
             "$STICKY_TTL": STICKY_TTL_S}
    for name, value in names.items():
        if isinstance(value, str):
            assert "'" not in value and "\\" not in value, value
            value = f"'{value}'"
        script = script.replace(name, str(value))
    return script


_ACQUIRE_TEXT = _written_in(_ACQUIRE)
_END = """
local backend = redis.call('GET', KEYS[1])
if backend then redis.call('ZREM', ARGV[1] .. backend, ARGV[2]) end
redis.call('DEL', KEYS[1])
return backend
"""


RECORDS_KEPT = 4096  # backends' records one process keeps a copy of, per routing Redis
JOBS_KEPT = 65536  # rollouts whose backend one process remembers (Router._remember)
STICKY_REFRESH_S = 3600.0  # a rollout that stays on its backend has its sticky key's expiry renewed this often
_UNKNOWN = ("", float("-inf"))


@dataclass(frozen=True)
class _Copies:
    """This process's copies of backends' records on one Redis: id -> (revision, record without
    its counters nor in-flight count, api key); ``argv``: their revisions as the acquire reads them,
    ``;id:rev;id:rev;``. Replaced whole on a change, so an acquire uses the copy it named."""

    records: dict[str, tuple[str, Backend, str | None]]
    argv: str = ";"


_NO_COPIES = _Copies({})


@dataclass
class Slot:
    """A backend chosen for one request: its record as the router read it when choosing (or this
    process's copy of that very revision; the router's counters ``served``, ``failures``,
    ``consecutive_failures`` are not carried: the registry has them), the key the record keeps out
    of its public view, and the request's in-flight lease."""

    backend: Backend
    api_key: str | None = None
    lease: HeldLease | None = None
    load: int = 0  # sessions (or requests in flight) the backend had besides this one when chosen
    project: str | None = None  # the rollout's project: its LLM quotas count this request
    acquired_at: float = field(default_factory=time.monotonic)

    @classmethod
    def direct(cls, backend_id: str, address: str, protocol: Protocol, api_key: str | None = None,
               **record: Any) -> Slot:
        """A slot on a server the router did not choose (a probe before registering, a fake, a
        test): ``record`` holds the other fields of :class:`Backend`; no lease."""
        backend = Backend(id=backend_id, address=address, protocol=protocol, capacity=1,
                          status=BackendStatus.ACTIVE, **record)
        return cls(backend, api_key)


class Router:
    """Acquire and release in-flight slots. ``acquire`` returns a Slot or the reason there is none:
    ``draining`` (wait for resume), ``quarantined`` (probe), ``none`` (nothing registered),
    ``quota`` (the rollout's project is at its ``max_llm_in_flight`` or ``tokens_per_hour``:
    wait for one of its calls to end, or for its hour to have room), ``share`` (every slot is
    taken and the project holds its weighted share of them: wait for a free slot)."""

    _copies: dict[tuple, _Copies] = {}  # per routing Redis (where), shared by the routers of this process
    _last: dict[tuple, tuple[str, float]] = {}  # (where, job) -> the backend this process last set, when
    _lock = threading.Lock()

    def __init__(self, client: redis.Redis, routing: redis.Redis | None = None):
        """``client``: the head's Redis; ``routing``: the routing's own (default: ``routing_url``'s,
        else the head's: :mod:`prorl_celery.llm.store`)."""
        self.head = client
        self.redis = client = routing if routing is not None else routing_redis(client)
        self.view = HeadView(self.head) if self.redis is not self.head else None
        self._acquire = client.register_script(_ACQUIRE_TEXT)
        self._end = client.register_script(_END)
        where = client.connection_pool.connection_kwargs
        self._where = tuple(where.get(k) for k in ("host", "port", "path", "db"))
        self.records_read = 0  # acquires whose reply carried the record (this process's copy was older)

    def acquire(self, job_id: str | None, protocol: Protocol | None = None,
                lease_s: float | None = None) -> Slot | str:
        settings = get_settings()
        lease_s = lease_s or settings.llm_lease_s
        token = uuid.uuid4().hex
        copies = self._copies.get(self._where, _NO_COPIES)
        now_ms, lease_ms = int(time.time() * 1000), int(lease_s * 1000)
        idle_cut = now_ms - int(settings.llm_session_idle_s * 1000)
        last, set_at = self._last.get((self._where, job_id), _UNKNOWN) if job_id else _UNKNOWN
        held = copies.records.get(last)
        refresh = time.monotonic() - set_at > STICKY_REFRESH_S  # (a job this process has not routed: now)
        args = [now_ms, now_ms + lease_ms, token, protocol.value if protocol else "",
                settings.llm_sticky_reprefill_turns, random.random(), job_id or "", idle_cut,
                "1" if random.random() < SWEEP_P else "0", lease_ms + 60000,
                f";{last}:{held[0]};" if held else copies.argv, "1" if refresh else "0", *self._head_facts(job_id)]
        reply = self._acquire(keys=[keys.llm_backends(), keys.llm_sticky(job_id or "-"), keys.job(job_id or "-"),
                                    keys.projects()], args=args)
        if reply[0] != b"ok":
            return reply[0].decode()
        bid, load, in_flight = reply[1].decode(), int(reply[2]), int(reply[3])
        if job_id and (bid != last or refresh):  # the script wrote the job's sticky key (and its expiry)
            self._remember(job_id, bid)
        if len(reply) > 6:  # this process's copy was missing or of an older revision
            backend, api_key = self._keep(bid, reply[4].decode(), reply[6])
        else:
            _, backend, api_key = copies.records[bid]
        project = reply[5].decode() if reply[5] else None
        return Slot(backend.model_copy(update={"in_flight": in_flight}), api_key,
                    HeldLease(self.redis, keys.llm_inflight(bid), token, lease_s,
                              also=keys.llm_project_inflight(project) if project else None), load, project=project)

    def _remember(self, job_id: str, bid: str) -> None:
        """The job's backend, as this process last wrote it: its next acquire names only that
        backend's copy (not every copy this process holds: a string that grew with the pool) and
        lets the script leave the sticky key's expiry alone for ``STICKY_REFRESH_S``."""
        last = self._last
        last[(self._where, job_id)] = (bid, time.monotonic())
        if len(last) > JOBS_KEPT:
            with self._lock:
                while len(last) > JOBS_KEPT:
                    last.pop(next(iter(last)), None)

    def _keep(self, bid: str, rev: str, flat: list[bytes]) -> tuple[Backend, str | None]:
        """The record of the reply, parsed without its counters, and kept as this process's copy
        of revision ``rev`` (a record without one, written before revisions were, is not kept)."""
        self.records_read += 1
        record = dict(zip(flat[0::2], flat[1::2]))
        for name in (*COUNTERS, REV):
            record.pop(name.encode(), None)
        raw_key = record.get(b"api_key")
        backend, api_key = parse_backend(record, 0), raw_key.decode() if raw_key else None
        if rev:  # (two threads at once may each drop the other's copy: it is read again, never wrong)
            now = self._copies.get(self._where, _NO_COPIES).records
            records = {**(now if len(now) < RECORDS_KEPT else {}), bid: (rev, backend, api_key)}
            argv = ";" + "".join(f"{i}:{r};" for i, (r, _, _) in records.items())
            self._copies[self._where] = _Copies(records, argv)
        return backend, api_key

    def _head_facts(self, job_id: str | None) -> list[str]:
        """The acquire's ARGV 13-16: read by the script itself on the head's Redis (``0``), else the
        job's project, its record and every project's weight, from the head (cached in this process)."""
        if self.view is None:
            return ["0"]
        mine = self.view.project_of(job_id) if job_id else ""
        if not mine:
            return ["1", "", "", "{}"]
        records, weights = self.view.projects()
        return ["1", mine, records.get(mine, ""), weights]

    def release(self, slot: Slot, outcome: str, wait: bool = True, tokens: int = 0) -> None:
        """``outcome``: ok (counts as served, and its latency per session of load updates the
        backend's measured speed), failed (counts as a failure) or aborted. ``wait=False``: sent
        later by this thread (:meth:`send_deferred`, e.g. once the caller has its answer), all
        of them in one round trip; the lease is held until then. ``tokens``: prompt plus
        generated tokens of the call, counted against its project's ``tokens_per_hour``.

        The lease leaves its sets by plain commands in one pipeline; the backend's counters and
        speed are written by this process within ``counts.FLUSH_S`` (a failure's at once):
        :mod:`prorl_celery.llm.counts`."""
        assert slot.lease is not None
        if outcome != "aborted":
            per_turn = (time.monotonic() - slot.acquired_at) / (slot.load + 1)
            counts.COUNTS.add(self.redis, self._where, slot.backend.id, outcome, per_turn)
        call = (slot.lease.key, slot.lease.token, slot.project, tokens)
        if wait:
            pipe = self.redis.pipeline(transaction=False)
            _queue_release(pipe, *call)
            pipe.execute()
        else:
            _deferred_of_thread().append((self, call))
        if outcome == "failed":
            counts.COUNTS.flush(self._where)

    @staticmethod
    def flush_counts() -> int:
        """Write this process's pending counters now (:mod:`prorl_celery.llm.counts`)."""
        return counts.COUNTS.flush()

    @staticmethod
    def send_deferred() -> int:
        """Send this thread's deferred releases (``release(wait=False)``), each Redis client's in
        one pipeline; returns how many. A release that fails is logged: its lease lapses by itself."""
        batch = _deferred_of_thread()
        if not batch:
            return 0
        calls, batch[:] = list(batch), []
        by_client: dict[int, tuple[Router, list]] = {}
        for router, call in calls:
            by_client.setdefault(id(router.redis), (router, []))[1].append(call)
        for router, items in by_client.values():
            try:
                pipe = router.redis.pipeline(transaction=False)
                for call in items:
                    _queue_release(pipe, *call)
                pipe.execute()
            except Exception as exc:  # noqa: BLE001 - the leases lapse by themselves
                log.warning("releasing %d LLM leases failed: %s", len(items), exc)
        return len(calls)

    def end_session(self, job_id: str) -> str | None:
        """The rollout is over: its backend stops counting it and its affinity is forgotten.
        Returns the backend it was on, if any."""
        self._last.pop((self._where, job_id), None)
        found = self._end(keys=[keys.llm_sticky(job_id)], args=[keys.llm_sessions(""), job_id])
        return found.decode() if found else None


def _queue_release(pipe: redis.client.Pipeline, lease_key: str, token: str, project: str | None,
                   tokens: int) -> None:
    """A lease's release: out of its backend's set and its project's, the call's tokens into the
    project's hour."""
    pipe.zrem(lease_key, token)
    if project:
        pipe.zrem(keys.llm_project_inflight(project), token)
        if tokens > 0:
            tokens_key, minute = keys.llm_project_tokens(project), int(time.time() // 60)
            pipe.hincrby(tokens_key, minute, tokens)
            if _tokens_expiry.get(tokens_key) != minute:  # an hour and a bit after this minute: once a minute
                _tokens_expiry[tokens_key] = minute
                pipe.expire(tokens_key, 3700)


_tokens_expiry: dict[str, int] = {}  # a project's tokens key -> the minute this process last renewed its expiry


_deferred = threading.local()


def _deferred_of_thread() -> list:
    batch = getattr(_deferred, "batch", None)
    if batch is None:
        batch = _deferred.batch = []
    return batch
