"""Bodies of the sandbox host's HTTP protocol, shared by :mod:`sandboxes.host.app` and
:mod:`sandboxes.client`, and the host's record in Redis. Error bodies are
:class:`prorl_celery.errors.ErrorBody`, as on every server of the service."""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sandboxes.base import SandboxSpec


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateRequest(_Body):
    job_id: str = Field(min_length=1, description="The job the sandbox belongs to (for sweeps).")
    spec: SandboxSpec = Field(default_factory=SandboxSpec)
    lease_s: float | None = Field(None, gt=0, description="Lease; default: settings.sandbox_lease_s.")


class ExecRequest(_Body):
    command: str
    timeout: float | None = Field(None, gt=0, description="Seconds; default: settings.action_timeout_s.")


class RenewRequest(_Body):
    lease_s: float | None = Field(None, gt=0, description="New lease length; default: the current one.")


class SandboxEntry(BaseModel):
    sandbox_id: str
    host_id: str
    job_id: str
    runtime: str
    created_at: float
    expires_at: float = Field(description="Lease expiry, unix time.")
    lease_s: float
    pid: int | None = None
    info: dict[str, Any] = Field(default_factory=dict)


class SandboxList(BaseModel):
    sandboxes: list[SandboxEntry]


class CloseResponse(BaseModel):
    closed: bool = Field(description="False when the sandbox was already gone.")


class CloseManyRequest(_Body):
    sandbox_ids: list[str] = Field(max_length=10_000, description="Sandboxes of this host to close.")


class CloseManyResponse(BaseModel):
    closed: list[str] = Field(description="Those this call closed; the others were already gone.")


class Health(BaseModel):
    status: str = "ok"
    host_id: str
    live: int
    capacity: int
    runtimes: list[str]
    auto: str | None = Field(None, description="What 'auto' resolves to here; None: refused.")
    isolation: dict[str, str] = Field(default_factory=dict, description="Runtime -> isolation.")
    limit_enforcement: dict[str, str] = Field(default_factory=dict,
                                              description="Limit -> how this node enforces it.")


_JSON_FIELDS = {"runtimes": "[]", "isolation": "{}", "limit_enforcement": "{}"}


class HostRecord(BaseModel):
    """The hash ``keys.host(host_id)`` a sandbox host writes on every heartbeat."""

    host_id: str
    address: str
    token: str
    runtimes: list[str]
    capacity: int
    live: int
    pid: int | None = None
    heartbeat_at: float = 0.0
    auto: str | None = Field(None, description="What 'auto' resolves to on this host; None: refused.")
    isolation: dict[str, str] = Field(default_factory=dict, description="Runtime -> isolation.")
    limit_enforcement: dict[str, str] = Field(default_factory=dict,
                                              description="Limit -> how this node enforces it.")

    @property
    def free(self) -> int:
        return self.capacity - self.live

    def to_redis(self) -> dict[str, str]:
        data = self.model_dump()
        for name in _JSON_FIELDS:
            data[name] = json.dumps(data[name])
        return {k: str(v) for k, v in data.items() if v is not None}

    @classmethod
    def from_redis(cls, raw: dict[Any, Any]) -> HostRecord:
        data = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in raw.items()}
        for name, empty in _JSON_FIELDS.items():
            data[name] = json.loads(data.get(name) or empty)
        return cls.model_validate(data)


def sandbox_block(entry: SandboxEntry) -> dict[str, Any]:
    """What a job's result says about the sandbox it ran in: runtime, isolation, network, image,
    the limits applied and how this node enforces them."""
    info = entry.info
    return {"runtime": entry.runtime, "isolation": info.get("isolation", "unknown"),
            "network": info.get("network"), "image": info.get("image"),
            "image_digest": info.get("image_digest"), "host_id": entry.host_id,
            "limits": info.get("limits", {}), "limit_enforcement": info.get("limit_enforcement", {})}
