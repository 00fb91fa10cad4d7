"""The Lua scripts of :class:`prorl_celery.jobs.JobStore`: each change of a job runs as one script,
so that its checks (whether the job exists, its status allows the change, its fields hold what
the caller expects) and its writes (the hash, the per-status sets and counts, the completion streams)
are one atomic step. Templates only: the store fills in the ttl and the terminal statuses and
registers them."""
from __future__ import annotations

# KEYS: job, queued set, group set ('' = none), counts hash, the project's counts hash ('' = none).
# ARGV: job id, counts field, fields...
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
if KEYS[5] ~= '' then redis.call('HINCRBY', KEYS[5], ARGV[2], 1) end
if KEYS[3] ~= '' then
  redis.call('SADD', KEYS[3], ARGV[1])
  redis.call('EXPIRE', KEYS[3], %(ttl)d)
end
return 1
"""

# KEYS: the job, its watchers (keys.job_watchers), its stage lease.
# ARGV: 1 allowed sources (csv, '' = any), 2 target ('' = keep), 3 required stage_state ('' = any),
#       4 status-set prefix, 5 counts hash, 6 ttl of terminal records, 7 completion stream,
#       8 group completion stream prefix, 9 number k of expected field/values pairs, 10 and 11
#       the key prefixes of a rollout's lists (a terminal job's expire with it), 12 the prefix of
#       the per-project counts hashes, 13 a stage lease token ('' = none: the lease is left alone),
#       14 that lease's ttl in ms: > 0, the change takes the lease (SET NX) once its checks pass
#       and happens only if it got it ({0, status, 'leased'} if another holds it); 0, a change
#       that happens releases the lease if it still holds the token; then those k pairs (each
#       field must hold one of the csv values; a missing field counts as ''), then the
#       field/value pairs to set.
# Counts are kept per "status|data_source": active statuses as gauges, terminal ones as totals;
# the same again per project for a project's job, and the project's sandboxes held
# (keys.project_sandboxes: a job entering init from queued adds its ``sandboxes`` need, 1 if it has
# none, and keeps what it added in ``sandboxes_held``; leaving the stages for queued or an end
# takes back exactly that, so a job stored before needs were counted takes back nothing). Completion entries name the job's project.
# A job reaching a terminal status is appended to the completion streams in the same step. A
# status change adds the job to the changed-set of every watch that reads it (prorl_celery/watch.py:
# a reading returns only those); a terminal status is final, so its watchers are forgotten.
_CHANGE = """
local function member(csv, v) return string.find(',' .. csv .. ',', ',' .. v .. ',', 1, true) end
local function change(A, cur)
if member('%(terminal)s', cur) then return {0, cur} end
if A[1] ~= '' and not member(A[1], cur) then return {0, cur} end
if A[3] ~= '' and redis.call('HGET', KEYS[1], 'stage_state') ~= A[3] then return {0, cur} end
local first = 15 + 2 * tonumber(A[9])
for i = 15, first - 1, 2 do
  if not member(A[i + 1], redis.call('HGET', KEYS[1], A[i]) or '') then return {0, cur} end
end
local lease_ms = tonumber(A[14])
if lease_ms > 0 and not redis.call('SET', KEYS[3], A[13], 'NX', 'PX', lease_ms) then return {0, cur, 'leased'} end
local target = A[2]
if target == '' then target = cur end
for i = first, #A, 2 do redis.call('HSET', KEYS[1], A[i], A[i + 1]) end
if target ~= cur then
  local meta = redis.call('HMGET', KEYS[1], 'job_id', 'data_source', 'group_id', 'project')
  local id, ds, group, project = meta[1], meta[2], meta[3], meta[4] or ''
  redis.call('HSET', KEYS[1], 'status', target)
  for _, w in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    redis.call('SADD', w, id)
    redis.call('EXPIRE', w, %(watch_ttl)d)
  end
  redis.call('SREM', A[4] .. cur, id)
  redis.call('HINCRBY', A[5], cur .. '|' .. ds, -1)
  redis.call('HINCRBY', A[5], target .. '|' .. ds, 1)
  if project ~= '' then
    redis.call('HINCRBY', A[12] .. project, cur .. '|' .. ds, -1)
    redis.call('HINCRBY', A[12] .. project, target .. '|' .. ds, 1)
    local function staged(s) return s == 'init' or s == 'run' or s == 'eval' end
    if staged(target) and not staged(cur) then
      local need = tonumber(redis.call('HGET', KEYS[1], 'sandboxes') or '') or 1
      redis.call('HSET', KEYS[1], 'sandboxes_held', need)
      redis.call('INCRBY', A[12] .. project .. ':sandboxes', need)
    elseif staged(cur) and not staged(target) then
      local held = tonumber(redis.call('HGET', KEYS[1], 'sandboxes_held') or '')
      if held then
        redis.call('DECRBY', A[12] .. project .. ':sandboxes', held)
        redis.call('HDEL', KEYS[1], 'sandboxes_held')
      end
    end
  end
  if member('%(terminal)s', target) then
    redis.call('DEL', KEYS[2])
    redis.call('EXPIRE', KEYS[1], tonumber(A[6]))
    redis.call('EXPIRE', A[10] .. id, tonumber(A[6]))
    redis.call('EXPIRE', A[11] .. id, tonumber(A[6]))
    local entry = {'job_id', id, 'status', target, 'group_id', group, 'data_source', ds, 'project', project}
    redis.call('XADD', A[7], 'MAXLEN', '~', 1000000, '*', unpack(entry))
    if group ~= '' then
      redis.call('XADD', A[8] .. group, '*', unpack(entry))
      redis.call('EXPIRE', A[8] .. group, tonumber(A[6]))
    end
  else
    redis.call('SADD', A[4] .. target, id)
  end
end
if lease_ms == 0 and A[13] ~= '' and redis.call('GET', KEYS[3]) == A[13] then redis.call('DEL', KEYS[3]) end
return {1, target}
end
"""
TRANSITION = _CHANGE + """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {0, ''} end
return change(ARGV, cur)
"""

# A stage's delivery admitted in one step (tasks/stages.py): the job read whole and, if the
# delivery may run, its change to the stage made as TRANSITION makes it, with the lease taken.
# KEYS: as TRANSITION's. ARGV: 1 the stage, 2 the statuses past it along the pipeline (csv: a
# delivery that finds one is a duplicate), 3 the stage before it (one that still runs there is
# early), 4 the worker's name, 5 now (seconds), then TRANSITION's ARGV (its target the stage,
# its lease taken) without the fields this computes: the stage's count in ``attempts`` and the
# worker in ``workers`` (JSON), and ``queue_s`` grown by the wait since ``t_enqueued`` unless
# the stage resumes. Returns {-1} for an unknown job; else {changed, status, why, the hash as it
# was before, attempts, queue_s}: why is TRANSITION's third element ('leased'), 'done' (a
# duplicate) or 'early' (the previous stage still runs), '' otherwise.
ADMIT = _CHANGE + """
local h = redis.call('HGETALL', KEYS[1])
if #h == 0 then return {-1} end
local rec = {}
for i = 1, #h, 2 do rec[h[i]] = h[i + 1] end
local stage, cur = ARGV[1], rec['status']
if member(ARGV[2], cur) or (cur == stage and rec['stage_state'] == 'done') then return {0, cur, 'done', h} end
if cur == ARGV[3] and rec['stage_state'] == 'running' then return {0, cur, 'early', h} end
local function json(s) if s == nil or s == '' then return {} end return cjson.decode(s) end
local attempts, workers = json(rec['attempts']), json(rec['workers'])
attempts[stage] = (tonumber(attempts[stage]) or 0) + 1
workers[stage] = ARGV[4]
local now, queue_s = tonumber(ARGV[5]), tonumber(rec['queue_s'] or '') or 0
if cur ~= stage then queue_s = queue_s + math.max(0, now - (tonumber(rec['t_enqueued'] or '') or 0)) end
local A = {unpack(ARGV, 6)}
local n = #A
A[n + 1], A[n + 2] = 'attempts', cjson.encode(attempts)
A[n + 3], A[n + 4] = 'workers', cjson.encode(workers)
A[n + 5], A[n + 6] = 'queue_s', string.format('%%.17g', queue_s)
local r = change(A, cur)
return {r[1], r[2], r[3] or '', h, A[n + 2], A[n + 6]}
"""

# KEYS: job, its rollout's calls list, its messages list. ARGV: 1 the stage (the status it must
# have, running), 2 accepted values of ``attempt`` (csv; a missing field counts as ''), 3 and 4
# the calls and messages saved so far, 5 number n of new calls, 6 the state (JSON), then the n
# packed calls, then the new messages. Whatever lies past the saved counts (a write of a delivery
# that lost the job) is trimmed, so a list holds exactly what the state counts: the append's reply
# (the list's length) tells, so a save is one HMGET, an RPUSH per list and the state's HSET.
SAVE = """
local f = redis.call('HMGET', KEYS[1], 'status', 'stage_state', 'attempt')
if f[1] ~= ARGV[1] or f[2] ~= 'running' then return 0 end
if not string.find(',' .. ARGV[2] .. ',', ',' .. (f[3] or '') .. ',', 1, true) then return 0 end
local function push(key, first, last)
  local len = nil
  for i = first, last, 4000 do len = redis.call('RPUSH', key, unpack(ARGV, i, math.min(i + 3999, last))) end
  return len or redis.call('LLEN', key)
end
local function extend(key, base, first, last)
  if push(key, first, last) > base + last - first + 1 then  -- a stray write lay past the saved count
    if base == 0 then redis.call('DEL', key) else redis.call('LTRIM', key, 0, base - 1) end
    push(key, first, last)
  end
end
local n = tonumber(ARGV[5])
extend(KEYS[2], tonumber(ARGV[3]), 7, 6 + n)
extend(KEYS[3], tonumber(ARGV[4]), 7 + n, #ARGV)
redis.call('HSET', KEYS[1], 'state', ARGV[6])
return 1
"""

# KEYS: a watch's set of job ids, its changed-set. ARGV: the job key prefix, the suffix of a
# job's watchers key, the set's ttl, the job records' ttl, how many ids follow to add, those ids,
# then ids to remove. Returns the set's size after the change, then id, status ... of each added job and of
# each watched job whose status changed since the last reading ('' for a job that is gone):
# O(changes), not O(watched jobs). A size other than the caller's count says the set lapsed.
WATCHED_STATUSES = """
local set, changed, prefix, wsuffix = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local ttl, job_ttl, n_add = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local out = {0}
local function read(id)
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', prefix .. id, 'status') or ''
end
for i = 6, 5 + n_add do
  redis.call('SADD', set, ARGV[i])
  redis.call('SADD', prefix .. ARGV[i] .. wsuffix, changed)
  redis.call('EXPIRE', prefix .. ARGV[i] .. wsuffix, job_ttl)
  read(ARGV[i])
end
for i = 6 + n_add, #ARGV do
  redis.call('SREM', set, ARGV[i])
  redis.call('SREM', prefix .. ARGV[i] .. wsuffix, changed)
end
local ids = redis.call('SMEMBERS', changed)
if #ids > 0 then
  redis.call('DEL', changed)
  for _, id in ipairs(ids) do
    if redis.call('SISMEMBER', set, id) == 1 then read(id) end
  end
end
out[1] = redis.call('SCARD', set)
if out[1] > 0 then redis.call('EXPIRE', set, ttl) end
return out
"""

# KEYS: job hashes. The status of each ('' for a job that is gone).
STATUSES = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('HGET', key, 'status') or '' end
return out
"""
