"""The sandbox protocol's vocabulary: one request and one response model per method of
:class:`~sandboxes.base.Sandbox` (:data:`METHODS`), used alike by the in-process runtimes, the
host's one generic route (:mod:`sandboxes.host.app`) and :class:`sandboxes.client.RemoteSandbox`
(as SWE-ReX's ``runtime/abstract.py``); the host's own bodies (create, list, bulk close, health)
and its record in Redis. Error bodies are :class:`prorl_celery.errors.ErrorBody`, as on every
server of the service.

A new operation is one method on :class:`~sandboxes.base.Sandbox` (implemented once, e.g. in
:class:`~sandboxes.runtimes.workspace.WorkspaceFiles`) plus its two models and its row here; :mod:`sandboxes.check` derives what it asks of a runtime
class from the rows.
"""
from __future__ import annotations

import json
import os
import stat as stat_mode
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prorl_celery.redisio import text
from sandboxes.base import LAYER_NAME, ExecResult, SandboxSpec


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateRequest(_Body):
    job_id: str = Field(min_length=1, description="The job the sandbox belongs to (for sweeps).")
    spec: SandboxSpec = Field(default_factory=SandboxSpec)
    lease_s: float | None = Field(None, gt=0, description="Lease; default: settings.sandbox_lease_s.")
    keeper: str | None = Field(None, description="A sandbox of this host and job whose lifetime this one shares "
                               "(a task's sidecar service beside the agent's): its lease is held while the keeper "
                               "lives, and it is closed with the keeper.")


# -- the protocol's methods: a request and a response each ---------------------------------
# A request's fields are the method's arguments, by name. A model with a ``bytes`` field
# ``data`` carries it as the raw HTTP body and its other fields in the query string.

class ExecRequest(_Body):
    command: str
    timeout: float | None = Field(None, gt=0, description="Seconds; default: settings.action_timeout_s.")


class Empty(_Body):
    """The request of a method without arguments."""


class InterruptResponse(BaseModel):
    interrupted: bool = True


class PathRequest(_Body):
    path: str = Field(min_length=1, description="Relative to the workspace, or absolute inside it.")


class ReadFileResponse(BaseModel):
    data: bytes


class WriteFileRequest(PathRequest):
    data: bytes


class WriteFileResponse(BaseModel):
    written: bool = True


class StatResult(BaseModel):
    """What :meth:`~sandboxes.base.Sandbox.stat` says of a path (a symlink is not followed)."""

    path: str
    kind: Literal["file", "dir", "link", "other"]
    size: int = Field(description="Bytes (a link: the length of its target).")
    mode: int = Field(description="Permission bits, e.g. 0o644.")
    mtime: float = Field(description="Last modification, unix time.")

    @classmethod
    def of(cls, path: str, st: os.stat_result) -> StatResult:
        kind = ("file" if stat_mode.S_ISREG(st.st_mode) else "dir" if stat_mode.S_ISDIR(st.st_mode)
                else "link" if stat_mode.S_ISLNK(st.st_mode) else "other")
        return cls(path=path, kind=kind, size=st.st_size, mode=stat_mode.S_IMODE(st.st_mode),
                   mtime=st.st_mtime)


class TreeRequest(_Body):
    paths: list[str] = Field(min_length=1, max_length=256, description="Absolute paths inside the sandbox.")
    max_bytes: int = Field(gt=0, description="Largest answer, bytes (the host's own cap, "
                           "sandbox_read_max_mb, applies too): past it, 413 file_too_large.")


class FinishRequest(TreeRequest):
    settle_s: float = Field(0.0, ge=0, le=5, description="Before the kill, watch the files this long: "
                            "one changed meanwhile (by a process left running) is named in ``rewritten``.")


class ExportTreeResponse(BaseModel):
    data: bytes = Field(description="The tar (sent as the raw body).")


class SandboxUsage(BaseModel):
    """What a sandbox used, as its cgroup counted it (read at close, before the group is removed;
    or on demand, in ``info``). A sandbox closed with its sidecars (those it keeps) counts theirs
    too: CPU-seconds added up, peaks added up (they run side by side: a bound of their joint peak)."""

    cpu_s: float | None = Field(None, description="CPU-seconds of all its processes (cpuacct.usage); "
                                "None where the node has no cpuacct hierarchy.")
    peak_memory_mb: float = Field(description="Peak of its memory cgroup (MiB; memory.max_usage_in_bytes: "
                                  "processes, page cache and tmpfs pages).")
    source: Literal["cgroup"] = "cgroup"
    sandboxes: int = Field(1, description="How many sandboxes the reading covers (it and its sidecars).")


def combine_usage(readings: list[dict[str, Any] | None]) -> SandboxUsage | None:
    """One reading of sandboxes closed together (each a :meth:`cgroup usage
    <sandboxes.runtimes.limits.cgroups.SandboxCgroup.usage>` or None: none measured it); None when
    none was measured (the ``local`` runtime, a host without cgroup v1 or not root, singularity)."""
    measured = [r for r in readings if r]
    if not measured:
        return None
    cpus = [r["cpu_s"] for r in measured if r.get("cpu_s") is not None]
    return SandboxUsage(cpu_s=round(sum(cpus), 6) if cpus else None, sandboxes=len(measured),
                        peak_memory_mb=round(sum(r["peak_memory_mb"] for r in measured), 3))


class FinishResponse(BaseModel):
    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    files: dict[str, bytes | None] = Field(description="Each path asked for -> its bytes (base64 "
                                           "in JSON), or null when missing or not a regular file.")
    mtimes_ns: dict[str, int] = Field(default_factory=dict, description="Each file read -> its "
                                      "modification time (ns, the node's clock): a grader tells a file "
                                      "written after its test ended by it.")
    killed_at_ns: int = Field(0, description="When the kill began (ns, the node's clock).")
    rewritten: list[str] = Field(default_factory=list, description="Paths that changed while "
                                 "settling, before the kill: something still running wrote them.")
    usage: SandboxUsage | None = Field(None, description="What it used (and its sidecars), read at "
                                       "close; None: not measured (no cgroup).")


class FreezeRequest(_Body):
    layer: str = Field(pattern=LAYER_NAME.pattern, description="The layer's name (the caller's key; "
                       "an existing layer of that name is kept).")
    group_id: str | None = Field(None, max_length=256, description="The group it serves (for the sweep).")
    job_id: str | None = Field(None, max_length=256, description="The job that prepared it.")
    timeout: float = Field(600.0, gt=0, le=3600, description="Seconds the copy may take.")


class LayerEntry(BaseModel):
    """A frozen layer (:mod:`sandboxes.runtimes.layers`) as its node lists it."""

    name: str
    created_at: float
    files: int = Field(0, description="Entries in it (files, directories, links, whiteouts).")
    bytes: int = 0
    group_id: str | None = None
    job_id: str | None = None
    in_use: bool = Field(False, description="A live sandbox holds it (it is not removed then).")


class LayerList(BaseModel):
    layers: list[LayerEntry]


class RemoveLayersRequest(_Body):
    layers: list[str] = Field(max_length=10_000, description="Names of layers of this host's node to remove.")


class RemoveLayersResponse(BaseModel):
    removed: list[str] = Field(description="Those removed; the others are in use or already gone.")


class InfoResponse(BaseModel):
    info: dict[str, Any]


class CloseResponse(BaseModel):
    closed: bool = Field(description="False when the sandbox was already gone.")
    usage: SandboxUsage | None = Field(None, description="What it used (and its sidecars), read just "
                                       "before the kill; None: already gone, or not measured (no cgroup).")


class RenewRequest(_Body):
    lease_s: float | None = Field(None, gt=0, description="New lease length; default: the current one.")


class RelayRequest(_Body):
    socket: str = Field(description="The session socket's name in the node's gateway directory (32 hex digits, .sock).")
    target: str | None = Field(None, description="host:port of the gateway on the worker's node: relay the socket there. "
                               "None: only say whether the socket is already here.")
    close: bool = Field(False, description="Remove the relay of that name.")
    key: str | None = Field(None, pattern=r"^[0-9a-f]{64}$",
                            description="The session's relay key (64 hex digits; with target): the relay proves it "
                                        "to the gateway, and the gateway to the relay, before a byte of a request "
                                        "crosses (prorl_celery/handshake.py).")


class RelayResponse(BaseModel):
    route: Literal["direct", "relay", "none", "closed"] = Field(
        description="direct: the gateway's own socket is on this node; relay: this host pipes the socket to "
                    "target; none: neither (ask again with a target); closed: the relay was removed.")
    path: str = Field("", description="The socket's path on this node: what the sandbox connects to.")


class ForwardRequest(_Body):
    to: str = Field(description="A sandbox of this host and of the same job: where each connection goes.")
    ports: list[int] = Field(min_length=1, max_length=16, description="TCP ports: each listened on at 127.0.0.1 in "
                             "this sandbox's network namespace, each connection spliced to 127.0.0.1 at the same "
                             "port in ``to``'s.")


class ForwardResponse(BaseModel):
    ports: list[int] = Field(description="The ports now forwarded.")


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
    keeper: str | None = Field(None, description="The sandbox this one lives and dies with (CreateRequest.keeper).")


class SandboxList(BaseModel):
    sandboxes: list[SandboxEntry]


class CloseManyRequest(_Body):
    sandbox_ids: list[str] = Field(max_length=10_000, description="Sandboxes of this host to close.")


class CloseManyResponse(BaseModel):
    closed: list[str] = Field(description="Those this call closed; the others were already gone.")


class Stray(BaseModel):
    """A container of a runtime on the host's node that no host holds
    (:meth:`~sandboxes.base.SandboxRuntime.strays`)."""

    runtime: str = Field(description="The runtime (as the host serves it) that can stop it.")
    name: str
    job_id: str = Field(description="The job it was started for.")
    started_at: float | None = None


class StrayList(BaseModel):
    strays: list[Stray]


class StopStraysRequest(_Body):
    strays: list[Stray] = Field(max_length=10_000, description="Strays of this host's node to stop.")


class StopStraysResponse(BaseModel):
    stopped: list[str] = Field(description="Names stopped.")
    failed: dict[str, str] = Field(default_factory=dict, description="Name -> why it could not be stopped.")


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


@dataclass(frozen=True)
class Method:
    """One protocol method: what it takes, what it answers, and which field of the answer the
    Python method returns (None: the whole model; ``""``: nothing). ``host_only``: an operation
    of the host on its record of the sandbox (the lease), not a method a runtime implements."""

    request: type[BaseModel]
    response: type[BaseModel]
    returns: str | None = None
    host_only: bool = False

    @property
    def arguments(self) -> tuple[str, ...]:
        """The Python method's parameters, by name: the request's fields, which the host passes
        as keywords."""
        return tuple(self.request.model_fields)

    def result(self, response: BaseModel) -> Any:
        return response if self.returns is None else getattr(response, self.returns, None)

    def respond(self, value: Any) -> BaseModel:
        """The response model of what the in-process method returned."""
        if isinstance(value, self.response):
            return value
        return self.response(**({self.returns: value} if self.returns else {}))

    @property
    def raw_request(self) -> bool:
        return "data" in self.request.model_fields

    @property
    def raw_response(self) -> bool:
        return "data" in self.response.model_fields


# method name (a method of Sandbox, except the host-only ones: renew, the lease; relay, a gateway's
# socket piped from another node; forward, ports of another sandbox of the job) -> its models
METHODS: dict[str, Method] = {
    "exec": Method(ExecRequest, ExecResult),
    "interrupt": Method(Empty, InterruptResponse, ""),
    "read_file": Method(PathRequest, ReadFileResponse, "data"),
    "write_file": Method(WriteFileRequest, WriteFileResponse, ""),
    "stat": Method(PathRequest, StatResult),
    "export_tree": Method(TreeRequest, ExportTreeResponse, "data"),
    "finish": Method(FinishRequest, FinishResponse),
    "freeze": Method(FreezeRequest, LayerEntry),
    "info": Method(Empty, InfoResponse, "info"),
    "close": Method(Empty, CloseResponse, "closed"),
    "renew": Method(RenewRequest, SandboxEntry, host_only=True),
    "relay": Method(RelayRequest, RelayResponse, host_only=True),
    "forward": Method(ForwardRequest, ForwardResponse, "ports", host_only=True),
}


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
        data = {text(k): text(v) for k, v in raw.items()}
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
