"""Projects: the tenants of one fleet, each with API keys of its own.

A project holds RL runs (a sweep, an ablation, an evaluation beside training) and owns every job,
group, completion and private LLM backend made with one of its keys. The operator's token
(``PRORL_API_TOKEN``) is no project's: it sees and acts on everything.

A key reads ``prorl_<key id>_<secret>``. Redis keeps, per key id, the project, a random salt and
``sha256(salt + secret)`` (:func:`prorl_celery.keys.project_keys`), never the secret: whoever reads
Redis cannot call the API with a project's key. Each request looks its key up afresh (one HGET), so
a revoked key is refused by the very next request, in every API process.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time

import redis
from pydantic import BaseModel, Field

from prorl_celery import keys
from prorl_celery.errors import InvalidRequest, UnknownProject
from prorl_celery.llm.store import HeadView
from prorl_celery.quotas import Quotas
from prorl_celery.redisio import text

NAME_PATTERN = r"^[a-z0-9][a-z0-9_.\-]{0,62}$"
KEY_PREFIX = "prorl"
_KEY = re.compile(rf"^{KEY_PREFIX}_([0-9a-f]{{16}})_([A-Za-z0-9_\-]{{32,128}})$")


class Project(BaseModel):
    """A project as ``projects list`` shows it."""

    name: str
    weight: float = Field(1.0, description="Its share of init slots and backends when projects compete (fair share).")
    created: float
    quotas: Quotas = Field(default_factory=Quotas, description="Its quotas (prorl_celery/quotas.py).")
    keys: list[str] = Field(default_factory=list, description="The ids of its live keys (never the secrets).")


class IssuedKey(BaseModel):
    """A new key: ``key`` is shown this once and stored only hashed."""

    project: str
    key_id: str
    key: str


def _digest(salt: bytes, secret: str) -> str:
    return hashlib.sha256(salt + secret.encode()).hexdigest()


class ProjectStore:
    def __init__(self, client: redis.Redis):
        self.redis = client

    def add(self, name: str, weight: float | None = None) -> IssuedKey:
        """A new key for project ``name``, creating the project if it is new (another key of an
        existing one: a rotation; revoke the old one after). ``weight``: set it (default 1)."""
        if not re.match(NAME_PATTERN, name):
            raise InvalidRequest(f"project name {name!r} must match {NAME_PATTERN}", field="name")
        if weight is not None and not weight > 0:
            raise InvalidRequest("weight must be a positive number", field="weight")
        raw = self.redis.hget(keys.projects(), name)
        record = json.loads(raw) if raw else {"weight": 1.0, "created": time.time()}
        if weight is not None:
            record["weight"] = float(weight)
        key_id, secret, salt = secrets.token_hex(8), secrets.token_urlsafe(32), secrets.token_bytes(16)
        stored = {"project": name, "salt": salt.hex(), "sha256": _digest(salt, secret), "created": time.time()}
        pipe = self.redis.pipeline()
        pipe.hset(keys.projects(), name, json.dumps(record))
        pipe.hset(keys.project_keys(), key_id, json.dumps(stored))
        pipe.execute()
        HeadView.changed()
        return IssuedKey(project=name, key_id=key_id, key=f"{KEY_PREFIX}_{key_id}_{secret}")

    def set_weight(self, name: str, weight: float) -> None:
        """Change an existing project's weight (UnknownProject otherwise)."""
        if not weight > 0:
            raise InvalidRequest("weight must be a positive number", field="weight")
        raw = self.redis.hget(keys.projects(), name)
        if raw is None:
            raise UnknownProject(name)
        self.redis.hset(keys.projects(), name, json.dumps({**json.loads(raw), "weight": float(weight)}))
        HeadView.changed()

    def set_quotas(self, name: str, changes: dict) -> Quotas:
        """Change an existing project's quotas (:meth:`Quotas.merged`); returns them as now stored."""
        raw = self.redis.hget(keys.projects(), name)
        if raw is None:
            raise UnknownProject(name)
        record = json.loads(raw)
        try:
            quotas = Quotas.model_validate(record.get("quotas") or {}).merged(changes)
        except ValueError as exc:
            raise InvalidRequest(str(exc), field="quotas") from None
        record["quotas"] = quotas.model_dump(exclude_none=True)
        self.redis.hset(keys.projects(), name, json.dumps(record))
        HeadView.changed()  # the routing's copy in this process (prorl_celery/llm/store.py)
        return quotas

    def list(self) -> list[Project]:
        by_project: dict[str, list[str]] = {}
        for key_id, raw in self.redis.hgetall(keys.project_keys()).items():
            by_project.setdefault(json.loads(raw)["project"], []).append(text(key_id))
        return sorted((Project(name=text(name), keys=sorted(by_project.get(text(name), [])), **json.loads(raw))
                       for name, raw in self.redis.hgetall(keys.projects()).items()), key=lambda p: p.name)

    def revoke(self, name_or_key: str) -> list[str]:
        """Revoke every key of a project (by name), or one key (by its id or the key itself);
        returns the key ids revoked. The project stays, with its jobs; ``add`` gives it a new key."""
        match = _KEY.match(name_or_key)
        key_id = match.group(1) if match else name_or_key
        if self.redis.hdel(keys.project_keys(), key_id):
            return [key_id]
        if not self.redis.hexists(keys.projects(), name_or_key):
            raise UnknownProject(name_or_key)
        ids = next((p.keys for p in self.list() if p.name == name_or_key), [])
        if ids:
            self.redis.hdel(keys.project_keys(), *ids)
        return ids

    def authenticate(self, credential: bytes) -> str | None:
        """The project whose live key ``credential`` is; None for anything else."""
        match = _KEY.match(credential.decode("ascii", "replace"))
        if match is None:
            return None
        raw = self.redis.hget(keys.project_keys(), match.group(1))
        if raw is None:
            return None
        stored = json.loads(raw)
        given = _digest(bytes.fromhex(stored["salt"]), match.group(2))
        return stored["project"] if hmac.compare_digest(given, stored["sha256"]) else None
