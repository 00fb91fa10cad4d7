"""Weighted fair share between projects, and the quotas that hold a project's rollouts.

Celery's queues are first come, first served: a project that submits 10,000 rollouts first would
hold every stage queue ahead of one that submits 10. So a project's jobs are not sent at once:
they wait in Redis, in the project's *pending* list (by ``priority``, then order), and a
dispatcher releases them to the init queue while the stage queues are shallow: at most
``fair_share_queue`` released jobs wait in any stage queue (for init, or for their next stage),
across every API process and worker, whatever is free is taken at once.

Which project's job goes next is stride scheduling (weighted fair queueing with unit cost): each
project with pending jobs has a *pass*; the lowest pass goes next and its pass grows by
1 / weight. A project that becomes active starts at the pass chosen last (it banks nothing while
idle). A project at a quota (:mod:`prorl_celery.quotas`) is passed over until it is below it; the
wait is written to its next job (``timings.quota_wait``). ``max_in_flight`` counts the project's
jobs in a stage or released; ``max_sandboxes`` sums their sandbox needs (each job's ``sandboxes``,
worked out at submission from its instance: :func:`tasks.handlers.sandbox_need`; the transition
script keeps the sum of those in a stage, :func:`prorl_celery.keys.project_sandboxes`), and holds the
next job while that sum plus its own need would pass the quota.

Everything is in Redis and done by two Lua scripts (:data:`_ENQUEUE`, :data:`_RELEASE`): admission
is atomic across API processes, and a restart loses nothing. Releases are attempted at every
submission, every stage start and every end (and by the beat's sweep); the caller sends the chains
of what was released. A released job whose message is lost is the requeue sweep's, as any other.
The operator's own jobs (no project) are sent at once, outside fair share.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable

import redis

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.errors import OverQuota, PolicyDenied
from prorl_celery.llm.store import routing_redis

# Counting a project's use, shared by both scripts. proj(p): its record (quotas, weight).
_COMMON = """
local function proj(p)
  local raw = redis.call('HGET', KEYS[1], p)
  local rec = raw and cjson.decode(raw) or {}
  rec.quotas = rec.quotas or {}
  rec.quotas.over = rec.quotas.over or {}
  return rec
end
local function in_stages(p)
  local n, flat = 0, redis.call('HGETALL', ARGV[1] .. p)
  for i = 1, #flat, 2 do
    local s = string.match(flat[i], '^(%a+)|')
    if s == 'init' or s == 'run' or s == 'eval' then n = n + tonumber(flat[i + 1]) end
  end
  return n
end
-- the sandboxes its jobs in a stage hold (keys.project_sandboxes, kept by the transition script)
local function sandboxes_held(p)
  return math.max(0, tonumber(redis.call('GET', ARGV[1] .. p .. ':sandboxes') or '0') or 0)
end
-- a stored job's sandbox need (1 for one stored without it)
local function need_of(id)
  return tonumber(redis.call('HGET', ARGV[4] .. id, 'sandboxes') or '') or 1
end
-- a pending job's entry in its project's pending-since hash, 'ms|need' ('ms' alone: from before
-- needs were kept): when it was enqueued and its need (nil)
local function entry(v)
  local ms, n = string.match(v or '', '^([%d.]+)|?(%d*)$')
  return tonumber(ms), tonumber(n)
end
-- routed: {requests in flight, the tokens hash flat} read by the caller from the routing's own
-- Redis (prorl_celery/llm/store.py); nil: they are here
local routed = nil
local function llm_in_flight(p, now)
  if routed then return routed[1] end
  return redis.call('ZCOUNT', ARGV[2] .. p, now, '+inf')
end
local function tokens_last_hour(p, now)
  local minute, used, oldest = math.floor(now / 60000), 0, {}
  local flat = routed and routed[2] or redis.call('HGETALL', ARGV[3] .. p)
  for i = 1, #flat, 2 do
    local m = tonumber(flat[i])
    if m > minute - 60 then used = used + tonumber(flat[i + 1]); table.insert(oldest, {m, tonumber(flat[i + 1])})
    elseif not routed then redis.call('HDEL', ARGV[3] .. p, flat[i]) end
  end
  return used, oldest, minute
end
"""

# KEYS: projects, active, vtime, pending(p), pending since(p), seq, waiting.
# ARGV: counts prefix, llm in-flight prefix, tokens prefix, job prefix, project, now ms,
#       retry-after s, n, then n (job id, priority, sandbox need) triples, then (when the routing
#       has a Redis of its own) the project's LLM requests in flight and its tokens hash as a JSON
#       array. Returns {'ok', new}, {'refused', quota, limit, retry after s}, or {'too_big', index
#       of the job, its need, max_sandboxes} for a new job that needs more sandboxes than the
#       project may ever hold (nothing added).
_ENQUEUE = _COMMON + """
local jprefix, p, now, retry = ARGV[4], ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local after = 9 + 3 * tonumber(ARGV[8])
if ARGV[after] then routed = {tonumber(ARGV[after]), cjson.decode(ARGV[after + 1])} end
local rec = proj(p)
local q, over = rec.quotas, rec.quotas.over
local new, new_need = {}, 0
for i = 0, tonumber(ARGV[8]) - 1 do
  local id, need = ARGV[9 + 3 * i], tonumber(ARGV[11 + 3 * i])
  if redis.call('EXISTS', jprefix .. id) == 0 and not redis.call('ZSCORE', KEYS[4], id) then
    if q.max_sandboxes and need > q.max_sandboxes then
      return {'too_big', tostring(i), tostring(need), tostring(q.max_sandboxes)}
    end
    table.insert(new, {id, tonumber(ARGV[10 + 3 * i]), need})
    new_need = new_need + need
  end
end
if over.max_in_flight == '429' or over.max_sandboxes == '429' then
  local held, boxes = in_stages(p) + redis.call('ZCARD', KEYS[4]) + #new, 0
  local count_boxes = over.max_sandboxes == '429' and q.max_sandboxes
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[7])) do
    local f = redis.call('HMGET', jprefix .. id, 'status', 'project', 'sandboxes')
    if f[1] == 'queued' and f[2] == p then held = held + 1; boxes = boxes + (tonumber(f[3] or '') or 1) end
  end
  if over.max_in_flight == '429' and q.max_in_flight and held > q.max_in_flight then
    return {'refused', 'max_in_flight', tostring(q.max_in_flight), tostring(retry)}
  end
  if count_boxes then
    boxes = boxes + sandboxes_held(p) + new_need
    for _, v in ipairs(redis.call('HVALS', KEYS[5])) do
      local _, n = entry(v)
      boxes = boxes + (n or 1)
    end
    if boxes > q.max_sandboxes then
      return {'refused', 'max_sandboxes', tostring(q.max_sandboxes), tostring(retry)}
    end
  end
end
if over.max_llm_in_flight == '429' and q.max_llm_in_flight and llm_in_flight(p, now) >= q.max_llm_in_flight then
  return {'refused', 'max_llm_in_flight', tostring(q.max_llm_in_flight), tostring(retry)}
end
if over.tokens_per_hour == '429' and q.tokens_per_hour then
  local used, oldest, minute = tokens_last_hour(p, now)
  if used >= q.tokens_per_hour then
    table.sort(oldest, function(a, b) return a[1] < b[1] end)
    local after = 60
    for _, mt in ipairs(oldest) do
      used = used - mt[2]
      after = (mt[1] + 60) * 60 - math.floor(now / 1000)
      if used < q.tokens_per_hour then break end
    end
    return {'refused', 'tokens_per_hour', tostring(q.tokens_per_hour), tostring(math.max(after, 1))}
  end
end
if #new == 0 then return {'ok', 0} end
local seq = redis.call('INCRBY', KEYS[6], #new) - #new
for i, job in ipairs(new) do
  redis.call('ZADD', KEYS[4], -job[2] * 1e12 + seq + i, job[1])
  redis.call('HSET', KEYS[5], job[1], now .. '|' .. job[3])
end
redis.call('ZADD', KEYS[2], 'NX', tonumber(redis.call('GET', KEYS[3]) or '0'), p)
return {'ok', #new}
"""

# KEYS: projects, active, vtime, waiting, held.
# ARGV: counts prefix, llm in-flight prefix, tokens prefix, job prefix, pending prefix,
#       pending-since prefix, now ms, queue cap, started job id ('' for none).
# Returns the released jobs as {id, data source, ...}.
_RELEASE = _COMMON + """
local jprefix, pprefix, sprefix = ARGV[4], ARGV[5], ARGV[6]
local now, cap = tonumber(ARGV[7]), tonumber(ARGV[8])
if ARGV[9] ~= '' then redis.call('SREM', KEYS[4], ARGV[9]) end
if redis.call('ZCARD', KEYS[2]) == 0 then return {} end
local queued_of, queued_need, waiting = {}, {}, 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  local f = redis.call('HMGET', jprefix .. id, 'status', 'stage_state', 'project', 'sandboxes')
  if not f[1] or f[2] == 'running' or not (f[1] == 'queued' or f[1] == 'init' or f[1] == 'run' or f[1] == 'eval') then
    redis.call('SREM', KEYS[4], id)
  else
    waiting = waiting + 1
    if f[1] == 'queued' and f[3] then
      queued_of[f[3]] = (queued_of[f[3]] or 0) + 1
      queued_need[f[3]] = (queued_need[f[3]] or 0) + (tonumber(f[4] or '') or 1)
    end
  end
end
local recs, stages, boxes, skip, out, drops = {}, {}, {}, {}, {}, 0
-- the quota that holds p's next job (needing `need` sandboxes), or nil: max_sandboxes sums the
-- needs of its jobs in a stage and released, max_in_flight counts them
local function over_quota(p, need)
  local q = recs[p].quotas
  if q.max_sandboxes then
    boxes[p] = boxes[p] or sandboxes_held(p)
    if boxes[p] + (queued_need[p] or 0) + need > q.max_sandboxes then return 'max_sandboxes' end
  end
  if q.max_in_flight then
    stages[p] = stages[p] or in_stages(p)
    if stages[p] + (queued_of[p] or 0) >= q.max_in_flight then return 'max_in_flight' end
  end
  return nil
end
while waiting < cap and drops < 1000 do
  local chosen, pass, head, need = nil, nil, nil, 1
  local act = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  for i = 1, #act, 2 do
    local p = act[i]
    if not skip[p] then
      local first = redis.call('ZRANGE', pprefix .. p, 0, 0)[1]
      if not first then
        redis.call('ZREM', KEYS[2], p)
        redis.call('HDEL', KEYS[5], p)
      else
        recs[p] = recs[p] or proj(p)
        local first_need = 1
        if recs[p].quotas.max_sandboxes then
          local _, n = entry(redis.call('HGET', sprefix .. p, first))
          first_need = n or need_of(first)
        end
        local quota = over_quota(p, first_need)
        if quota then
          if not redis.call('HGET', KEYS[5], p) then redis.call('HSET', KEYS[5], p, now .. '|' .. quota) end
        else
          chosen, pass, head, need = p, tonumber(act[i + 1]), first, first_need
          break
        end
      end
    end
  end
  if not chosen then break end
  local f = redis.call('HMGET', jprefix .. head, 'status', 'project', 'data_source', 't_created')
  local since = entry(redis.call('HGET', sprefix .. chosen, head)) or now
  if not f[1] and now - since < 30000 then
    skip[chosen] = true  -- its submitter stores it in a moment, and releases it then
  else
    redis.call('ZREM', pprefix .. chosen, head)
    redis.call('HDEL', sprefix .. chosen, head)
    if f[1] == 'queued' and f[2] == chosen then
      local fields = {'t_released', now / 1000}
      local held = redis.call('HGET', KEYS[5], chosen)
      if held then
        local t, quota = string.match(held, '^([%d.]+)|(.*)$')
        local wait = math.max(0, now - math.max(tonumber(t), (tonumber(f[4]) or 0) * 1000)) / 1000
        table.insert(fields, 'quota_wait_s'); table.insert(fields, wait)
        table.insert(fields, 'quota_held'); table.insert(fields, quota)
        redis.call('HDEL', KEYS[5], chosen)
      end
      redis.call('HSET', jprefix .. head, unpack(fields))
      redis.call('SADD', KEYS[4], head)
      waiting = waiting + 1
      queued_of[chosen] = (queued_of[chosen] or 0) + 1
      queued_need[chosen] = (queued_need[chosen] or 0) + need
      redis.call('SET', KEYS[3], pass)
      redis.call('ZADD', KEYS[2], pass + 1 / math.max(tonumber(recs[chosen].weight) or 1, 1e-6), chosen)
      table.insert(out, head)
      table.insert(out, f[3])
    else
      drops = drops + 1  -- cancelled while pending, or never stored
    end
  end
end
return out
"""


def _prefixes() -> list[str]:
    return [keys.job_counts_of(""), keys.llm_project_inflight(""), keys.llm_project_tokens(""), keys.job("")]


class FairShare:
    """The per-project pending lists and their dispatcher (one per Redis client)."""

    def __init__(self, client: redis.Redis):
        self.redis = client
        self.routing = routing_redis(client)
        self._enqueue = client.register_script(_ENQUEUE)
        self._release = client.register_script(_RELEASE)

    def enqueue(self, project: str, jobs: Iterable[tuple[str, int] | tuple[str, int, int]]) -> int:
        """Add ``(job id, priority[, sandbox need])`` to ``project``'s pending list (a job id
        already stored or pending is left out; no need: 1); returns how many were added. Raises
        :class:`OverQuota` (nothing added) while the project is at a quota whose ``over`` is 429,
        and :class:`PolicyDenied` (nothing added) for a new job that needs more sandboxes at once
        than the project's ``max_sandboxes``: it could never be released."""
        flat = [x for job in jobs for x in (job[0], int(job[1]), int(job[2]) if len(job) > 2 else 1)]
        reply = self._enqueue(
            keys=[keys.projects(), keys.fair_active(), keys.fair_vtime(), keys.fair_pending(project),
                  keys.fair_pending_since(project), keys.fair_seq(), keys.fair_waiting()],
            args=[*_prefixes(), project, int(time.time() * 1000), get_settings().quota_retry_after_s,
                  len(flat) // 3, *flat, *self._routed(project)])
        if reply[0] == b"refused":
            quota, limit, after = (x.decode() for x in reply[1:])
            raise OverQuota(project, quota, int(limit), max(1, int(float(after))))
        if reply[0] == b"too_big":
            index, need, limit = (int(x) for x in reply[1:])
            which = f"job {index} of the batch" if len(flat) > 3 else "the job"
            raise PolicyDenied(f"{which} holds up to {need} sandboxes at once, more than project {project!r}'s "
                               f"max_sandboxes ({limit}): it could never start; the operator may raise the quota",
                               field="instance")
        return int(reply[1])

    def _routed(self, project: str) -> list[str | int]:
        """The project's LLM counters when the routing keeps them on a Redis of its own: read there
        first, a moment before the script decides on them on the head (a refusal at ``over: 429`` is
        an admission heuristic against counts that move every turn; the router's own check of the
        same quotas, in its acquire, is the exact one)."""
        if self.routing is self.redis:
            return []
        pipe = self.routing.pipeline(transaction=False)
        pipe.zcount(keys.llm_project_inflight(project), int(time.time() * 1000), "+inf")
        pipe.hgetall(keys.llm_project_tokens(project))
        in_flight, tokens = pipe.execute()
        return [in_flight, json.dumps([x.decode() for pair in tokens.items() for x in pair])]

    def release(self, started: str | None = None, cap: int | None = None) -> list[tuple[str, str]]:
        """Release pending jobs while the stage queues are shallow; returns ``(job id, data
        source)`` of each, whose chain the caller sends. ``started``: a job whose stage just
        began (it no longer waits in a queue). ``cap``: instead of ``fair_share_queue``."""
        out = self._release(
            keys=[keys.projects(), keys.fair_active(), keys.fair_vtime(), keys.fair_waiting(), keys.fair_held()],
            args=[*_prefixes(), keys.fair_pending(""), keys.fair_pending_since(""), int(time.time() * 1000),
                  cap or get_settings().fair_share_queue, started or ""])
        return [(out[i].decode(), out[i + 1].decode()) for i in range(0, len(out), 2)]

    def waiting_for_next(self, job_id: str) -> None:
        """The job's stage is done and its next one is queued: it waits in a queue again."""
        self.redis.sadd(keys.fair_waiting(), job_id)

    def forget(self, jobs: Iterable[tuple[str, str]]) -> None:
        """``(project, job id)`` of pending jobs that ended (cancelled): out of their lists now,
        not when the release script meets them."""
        pipe = self.redis.pipeline(transaction=False)
        for project, job_id in jobs:
            pipe.zrem(keys.fair_pending(project), job_id)
            pipe.hdel(keys.fair_pending_since(project), job_id)
        pipe.execute()

    def pending(self, project: str) -> int:
        return int(self.redis.zcard(keys.fair_pending(project)))

    def sandboxes(self, projects: list[str]) -> list[int]:
        """The sandboxes each project's jobs in init, run or eval may hold now (their needs summed)."""
        if not projects:
            return []
        return [max(0, int(x or 0)) for x in self.redis.mget([keys.project_sandboxes(p) for p in projects])]

