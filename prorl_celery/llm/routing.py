"""Choosing a backend for one request, atomically in Redis.

One Lua script drops expired in-flight leases, computes each eligible active backend's load
(in-flight / capacity), keeps the rollout on its sticky backend unless that one is overloaded
(load above ``factor`` x the least load *and* above it by ``margin``), otherwise takes the least
loaded (a random one among ties), adds the request's lease and records stickiness.
"""
from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass

import redis

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.llm.models import Dialect, Protocol
from prorl_celery.llm.transport import HeldLease

STICKY_TTL_S = 6 * 3600

_ACQUIRE = """
local now, lease_ms, token = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local want, factor, margin, r = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local sticky_ttl, bprefix, iprefix, use_sticky = ARGV[8], ARGV[9], ARGV[10], ARGV[11] == '1'
local best, best_load, loads = {}, nil, {}
local seen = {draining = false, quarantined = false}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local f = redis.call('HMGET', bprefix .. id, 'status', 'capacity', 'protocol')
  if f[1] and (want == '' or f[3] == want) then
    if f[1] == 'active' then
      local ik = iprefix .. id
      redis.call('ZREMRANGEBYSCORE', ik, '-inf', now)
      local load = redis.call('ZCARD', ik) / math.max(tonumber(f[2]) or 1, 1)
      loads[id] = load
      if best_load == nil or load < best_load - 1e-9 then
        best, best_load = {id}, load
      elseif load <= best_load + 1e-9 then
        table.insert(best, id)
      end
    else
      seen[f[1]] = true
    end
  end
end
if best_load == nil then
  if seen.draining then return {'draining'} end
  if seen.quarantined then return {'quarantined'} end
  return {'none'}
end
table.sort(best)
local chosen = best[math.min(math.floor(r * #best) + 1, #best)]
local sticky = use_sticky and redis.call('GET', KEYS[2])
if sticky and loads[sticky] then
  local ls = loads[sticky]
  if not (ls > factor * best_load and ls - best_load > margin) then chosen = sticky end
end
redis.call('ZADD', iprefix .. chosen, now + lease_ms, token)
if use_sticky then redis.call('SET', KEYS[2], chosen, 'EX', sticky_ttl) end
local h = redis.call('HMGET', bprefix .. chosen, 'address', 'protocol', 'model', 'weight_version',
                     'max_model_len', 'tokenizer', 'api_key', 'dialect', 'logprobs_mode')
return {'ok', chosen, h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8], h[9]}
"""

_RELEASE = """
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
  if ARGV[2] == 'ok' then
    redis.call('HINCRBY', KEYS[2], 'served', 1)
    redis.call('HSET', KEYS[2], 'consecutive_failures', 0)
  elseif ARGV[2] == 'failed' then
    redis.call('HINCRBY', KEYS[2], 'failures', 1)
    redis.call('HINCRBY', KEYS[2], 'consecutive_failures', 1)
  end
end
return removed
"""


@dataclass
class Slot:
    """A backend chosen for one request, with the request's in-flight lease."""

    backend_id: str
    address: str
    protocol: Protocol
    model: str | None = None
    weight_version: str | None = None
    max_model_len: int | None = None
    tokenizer: str | None = None
    api_key: str | None = None
    lease: HeldLease | None = None
    dialect: Dialect | None = None
    logprobs_mode: str | None = None


class Router:
    """Acquire and release in-flight slots. ``acquire`` returns a Slot or the reason there is none:
    ``draining`` (wait for resume), ``quarantined`` (probe), ``none`` (nothing registered)."""

    def __init__(self, client: redis.Redis):
        self.redis = client
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)

    def acquire(self, job_id: str | None, protocol: Protocol | None = None,
                lease_s: float | None = None) -> Slot | str:
        settings = get_settings()
        lease_s = lease_s or settings.llm_lease_s
        token = uuid.uuid4().hex
        args = [int(time.time() * 1000), int(lease_s * 1000), token,
                protocol.value if protocol else "", settings.llm_sticky_overload_factor,
                settings.llm_sticky_overload_margin, random.random(), STICKY_TTL_S,
                keys.llm_backend(""), keys.llm_inflight(""), "1" if job_id else "0"]
        reply = self._acquire(keys=[keys.llm_backends(), keys.llm_sticky(job_id or "-")], args=args)
        if reply[0] != b"ok":
            return reply[0].decode()
        bid, address, proto, model, version, max_len, tokenizer, api_key, dialect, lp_mode = (
            None if v is None else v.decode() for v in reply[1:11])
        return Slot(bid, address, Protocol(proto or "chat"), model, version,
                    int(max_len) if max_len else None, tokenizer, api_key,
                    HeldLease(self.redis, keys.llm_inflight(bid), token, lease_s),
                    Dialect(dialect) if dialect else None, lp_mode)

    def release(self, slot: Slot, outcome: str) -> None:
        """``outcome``: ok (counts as served), failed (counts as a failure) or aborted."""
        assert slot.lease is not None
        self._release(keys=[slot.lease.key, keys.llm_backend(slot.backend_id)],
                      args=[slot.lease.token, outcome])
