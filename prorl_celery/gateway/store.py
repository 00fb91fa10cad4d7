"""Where a session's calls go: appended once, read back whole.

:class:`CallStore` is the small interface (append a record; read a session's records) so that the
records can move onto the service's append-only rollout store; :class:`RedisCallStore` keeps them
in one Redis list per session (RPUSH: an append never rewrites what is there)."""
from __future__ import annotations

from typing import Protocol

import redis

from prorl_celery import keys
from prorl_celery.gateway.models import CallRecord

RECORD_TTL_S = 7 * 24 * 3600  # as long as a finished job's record lives


class CallStore(Protocol):
    def append(self, session_id: str, record: CallRecord) -> None:
        """Add one call at the end of the session's list."""

    def records(self, session_id: str) -> list[CallRecord]:
        """Every call of the session, in the order appended."""


class RedisCallStore:
    def __init__(self, client: redis.Redis, ttl_s: int = RECORD_TTL_S):
        self.redis = client
        self.ttl_s = ttl_s

    def append(self, session_id: str, record: CallRecord) -> None:
        key = keys.gateway_calls(session_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(key, record.model_dump_json())
        pipe.expire(key, self.ttl_s)
        pipe.execute()

    def records(self, session_id: str) -> list[CallRecord]:
        raw = self.redis.lrange(keys.gateway_calls(session_id), 0, -1)
        return [CallRecord.model_validate_json(item) for item in raw]


class MemoryCallStore:
    """In process, for unit tests and the benchmark's gateway-only runs."""

    def __init__(self) -> None:
        self.data: dict[str, list[CallRecord]] = {}

    def append(self, session_id: str, record: CallRecord) -> None:
        self.data.setdefault(session_id, []).append(record)

    def records(self, session_id: str) -> list[CallRecord]:
        return list(self.data.get(session_id, []))
