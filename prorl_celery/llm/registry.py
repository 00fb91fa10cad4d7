"""The backend registry in Redis, shared by every worker and the API.

Per backend: a hash (``keys.llm_backend``) with address, protocol, capacity, status, weight
version, counters and measured seconds per turn (``turn_s``), a sorted set (``keys.llm_inflight``)
of in-flight request leases whose scores are their expiry times (the live in-flight count is the
number of unexpired members), and a sorted set of its rollouts' sessions (``keys.llm_sessions``, see
``routing``); all on the routing's Redis (:mod:`prorl_celery.llm.store`).

**The revision.** Each process keeps a copy of the records it routed to (``routing``), and the
acquire sends the whole record only when that copy is not the current one. What tells them apart is
the hash's ``rev``: a fresh random token written in the same atomic step as any other field, by
the registration script (``_ADD``) or by :meth:`BackendRegistry.write`, the one way everything else
(status, drain, pause, resume, weight version, quarantine, probes, pause expiry) writes a backend's
hash. Random, not counted: a backend removed and registered again, or a routing Redis that lost its
last second in a crash, never gives an old revision back with other contents. The router's own
counters (``COUNTERS``: served, failures, consecutive failures, seconds per turn), which each
release writes, are outside it: no process copies them, so a release does not make the copies old.
tests/llm/test_backend_rev.py checks that no other code writes a backend's hash.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

import redis

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.errors import InvalidRequest, UnknownBackend
from prorl_celery.llm.models import Backend, BackendSpec, BackendStatus
from prorl_celery.llm.store import routing_redis

REV = "rev"  # the field that names the record's revision (see the module's docstring)
# written by the router (counts._COUNTS, for every release), outside the revision: no process keeps a copy of them
COUNTERS = ("served", "failures", "consecutive_failures", "turn_s")

# a registration, or the same address again: its fields and a new revision (ARGV[5]) in one step
_ADD = """
local created = redis.call('SADD', KEYS[1], ARGV[1])
if created == 1 then
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
  redis.call('HSET', KEYS[2], 'id', ARGV[1], 'status', 'active', 'served', 0, 'failures', 0,
             'consecutive_failures', 0, 'added_at', ARGV[2], 'status_since', ARGV[2],
             'protocol', ARGV[3], 'capacity', ARGV[4])
end
for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[2], 'rev', ARGV[5])
return created
"""
# every other write of a registered backend's hash (BackendRegistry.write): -1 if it is not
# registered, 0 if the guard (a field's value) did not hold, else 1 + (1 if the status moved)
_WRITE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local w = cjson.decode(ARGV[2])
if w.only_if and redis.call('HGET', KEYS[1], w.only_if[1]) ~= w.only_if[2] then return 0 end
local wrote, moved = false, 0
if w.status then  -- only from the listed states
  local current = redis.call('HGET', KEYS[1], 'status')
  for _, from in ipairs(w.status.from) do
    if current == from then
      redis.call('HSET', KEYS[1], 'status', w.status.to, 'status_since', w.status.at)
      wrote, moved = true, 1
      break
    end
  end
end
for name, value in pairs(w.set) do
  redis.call('HSET', KEYS[1], name, value)
  wrote = true
end
for _, name in ipairs(w.unset) do
  if redis.call('HDEL', KEYS[1], name) == 1 then wrote = true end
end
if wrote then redis.call('HSET', KEYS[1], 'rev', ARGV[1]) end
return 1 + moved
"""
_INT_FIELDS = ("capacity", "served", "failures", "consecutive_failures", "max_model_len")
_FLOAT_FIELDS = ("added_at", "status_since")


def normalize_address(address: str) -> str:
    """``host:port``, ``http://host:port/``, ``http://host:port/v1`` all name the same backend."""
    text = address.strip()
    if "://" not in text:
        text = f"http://{text}"
    text = text.rstrip("/")
    if text.endswith("/v1"):
        text = text[: -len("/v1")]
    try:
        parts = urlsplit(text)
        parts.port
    except ValueError:
        raise InvalidRequest(f"address {address!r} has an invalid port", field="address") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(f"address {address!r} is not an http(s)://host:port URL", field="address")
    return text


def backend_id(address: str, project: str | None = None) -> str:
    """A stable id derived from the normalized address, so the same address is one backend; a
    project's private registration of it is another (its id tells nothing of the shared one's)."""
    scoped = normalize_address(address) if not project else f"{project}|{normalize_address(address)}"
    return "llm-" + hashlib.sha1(scoped.encode()).hexdigest()[:10]


class BackendRegistry:
    """The registry on the routing's Redis (:mod:`prorl_celery.llm.store`): ``client`` is the
    head's (``head``: weight versions, job records), ``routing`` the routing's own (default:
    ``routing_url``'s, else the head's). ``redis`` is where the backends live."""

    def __init__(self, client: redis.Redis, routing: redis.Redis | None = None):
        self.head = client
        self.redis = routing if routing is not None else routing_redis(client)

    # -- registration ---------------------------------------------------------------------
    def add(self, spec: BackendSpec, project: str | None = None) -> tuple[Backend, bool]:
        """Register ``spec``: shared (every project's jobs may use it), or private to ``project``
        (only its jobs); the same address again by the same owner updates only the fields it
        sets explicitly. Returns (backend, created)."""
        address = normalize_address(spec.address)
        bid = backend_id(address, project)
        fields: dict[str, object] = {"address": address, **({"project": project} if project else {})}
        for name in ("protocol", "dialect", "capacity", "model", "weight_version", "max_model_len",
                     "tokenizer", "api_key", "logprobs_mode", "pause_api", "tool_parser", "routed_experts"):
            value = getattr(spec, name)
            if value is not None and name in spec.model_fields_set:
                fields[name] = value.value if name in ("protocol", "pause_api") else (
                    int(value) if isinstance(value, bool) else value)
        argv = [bid, time.time(), spec.protocol.value, spec.capacity or get_settings().llm_default_capacity,
                new_rev()]
        argv += [item for pair in fields.items() for item in pair]
        created = self.redis.eval(_ADD, 4, keys.llm_backends(), keys.llm_backend(bid),
                                  keys.llm_inflight(bid), keys.llm_sessions(bid), *argv)
        return self.get(bid), bool(created)

    def remove(self, bid: str) -> None:
        """Forget the backend; its in-flight requests lose their leases and retry elsewhere."""
        pipe = self.redis.pipeline()
        pipe.srem(keys.llm_backends(), bid)
        pipe.delete(keys.llm_backend(bid), keys.llm_inflight(bid), keys.llm_sessions(bid))
        pipe.incr(keys.llm_withdrawals())  # the keepers then look for the leases gone (prorl_celery/leases.py)
        if not pipe.execute()[0]:
            raise UnknownBackend(bid)

    def clear(self, ids: list[str] | None = None) -> list[str]:
        """Forget ``ids`` (None: every backend); returns them."""
        ids = self.ids() if ids is None else ids
        for bid in ids:
            try:
                self.remove(bid)
            except UnknownBackend:
                pass
        return ids

    # -- reading --------------------------------------------------------------------------
    def ids(self) -> list[str]:
        return sorted(member.decode() for member in self.redis.smembers(keys.llm_backends()))

    def get(self, bid: str) -> Backend:
        found = self.get_many([bid])
        if not found:
            raise UnknownBackend(bid)
        return found[0]

    def get_many(self, ids: Iterable[str]) -> list[Backend]:
        ids = list(ids)
        now_ms = int(time.time() * 1000)
        pipe = self.redis.pipeline(transaction=False)
        for bid in ids:
            pipe.hgetall(keys.llm_backend(bid))
            pipe.zcount(keys.llm_inflight(bid), now_ms, "+inf")
        replies = pipe.execute()
        out = []
        for raw, in_flight in zip(replies[0::2], replies[1::2]):
            if raw:
                out.append(parse_backend(raw, in_flight))
        return out

    def list(self) -> list[Backend]:
        return sorted(self.get_many(self.ids()), key=lambda b: (b.added_at, b.id))

    def in_flight(self, bid: str) -> int:
        return self.redis.zcount(keys.llm_inflight(bid), int(time.time() * 1000), "+inf")

    def resolve(self, ids: list[str] | None) -> list[str]:
        """``ids`` checked to exist (UnknownBackend otherwise), or every backend when None."""
        if ids is None:
            return self.ids()
        known = set(self.ids())
        for bid in ids:
            if bid not in known:
                raise UnknownBackend(bid)
        return list(ids)

    # -- status and fields: every write of a backend's hash but the router's counters -----------
    def write(self, bid: str, fields: dict[str, object] | None = None, unset: Iterable[str] = (),
              status: tuple[BackendStatus, Iterable[BackendStatus]] | None = None,
              only_if: tuple[str, str] | None = None) -> int:
        """One atomic write of a registered backend's hash, with a new revision if anything changed
        (the module's docstring): ``fields`` set (None values skipped) and ``unset``, the status moved
        to ``status[0]`` if it is one of ``status[1]``; only if the field ``only_if[0]`` holds
        ``only_if[1]``. Returns -1 (not registered: nothing written), 0 (the guard failed), 1
        (written; the status did not move), 2 (the status moved)."""
        plan: dict[str, object] = {"set": {k: _stored(v) for k, v in (fields or {}).items() if v is not None},
                                   "unset": list(unset)}
        if status is not None:
            plan["status"] = {"to": status[0].value, "from": [s.value for s in status[1]], "at": repr(time.time())}
        if only_if is not None:
            plan["only_if"] = list(only_if)
        if not plan["set"]:
            plan["set"] = _EMPTY  # cjson reads an empty list and an empty object alike
        if not plan["unset"]:
            plan["unset"] = _EMPTY
        return int(self.redis.eval(_WRITE, 1, keys.llm_backend(bid), new_rev(), json.dumps(plan)))

    def set_status(self, bid: str, status: BackendStatus, sources: Iterable[BackendStatus]) -> bool:
        changed = self.write(bid, status=(status, sources))
        if changed == -1:
            raise UnknownBackend(bid)
        return changed == 2

    def set_fields(self, bid: str, **fields: object) -> None:
        """Fields of a registered backend (one not registered is left alone)."""
        self.write(bid, fields=fields)

    def clear_fields(self, bid: str, *names: str) -> None:
        self.write(bid, unset=names)

    def reactivate(self, bid: str, weight_version: str | None, sources: Iterable[BackendStatus]) -> None:
        """After a pause: the new weight version, failures forgotten, back to active, in one step."""
        if self.write(bid, fields={"consecutive_failures": 0, "weight_version": weight_version},
                      unset=["paused_mode"], status=(BackendStatus.ACTIVE, sources)) == -1:
            raise UnknownBackend(bid)

    def claim_pause_expiry(self, bid: str, paused_until: bytes) -> bool:
        """Delete the backend's pause deadline only if it is still ``paused_until`` (as read): of the
        turns that found it past, one resumes the backend, and never a newer pause that replaced it."""
        return self.write(bid, unset=["paused_until"], only_if=("paused_until", paused_until.decode())) > 0

    def api_key(self, bid: str) -> str | None:
        """The bearer token the server requires (kept out of the public record)."""
        raw = self.redis.hget(keys.llm_backend(bid), "api_key")
        return raw.decode() if raw else None

    def abort_in_flight(self, bid: str) -> int:
        """Drop every in-flight lease of the backend; the holders abort their calls and retry."""
        pipe = self.redis.pipeline()
        pipe.zcard(keys.llm_inflight(bid))
        pipe.delete(keys.llm_inflight(bid))
        pipe.incr(keys.llm_withdrawals())
        return pipe.execute()[0]


_EMPTY: list = []


def new_rev() -> str:
    """A fresh revision of a backend's record: random, so none comes back with other contents."""
    return secrets.token_hex(8)


def _stored(value: object) -> str:
    """A field's value as redis-py would send it (a float's repr, a bool as 0/1)."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


def parse_backend(raw: dict[bytes, bytes], in_flight: int) -> Backend:
    """The record of a backend's hash (``keys.llm_backend``); its ``api_key`` is left out."""
    data: dict[str, object] = {k.decode(): v.decode() for k, v in raw.items()}
    data.pop("api_key", None)
    for name in _INT_FIELDS:
        if name in data:
            data[name] = int(data[name])
    for name in _FLOAT_FIELDS:
        if name in data:
            data[name] = float(data[name])
    data.setdefault("capacity", get_settings().llm_default_capacity)
    return Backend(in_flight=in_flight, **data)
