"""Response bodies of the API, as pydantic models: the OpenAPI document is built from them."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prorl_celery.errors import ErrorBody, ErrorDetail  # noqa: F401 - one error body for every server
from prorl_celery.models import JobView


class SubmitResponse(BaseModel):
    job_ids: list[str]
    warnings: list[dict[str, Any]] | None = Field(None, description="Accepted with a warning: a task the hack "
                                                                     "audit found hackable (PRORL_AUDIT_POLICY=warn).")


class SandboxHostHealth(BaseModel):
    host_id: str
    address: str
    runtimes: list[str] = Field(description="The runtimes this host serves, and no others.")
    auto: str | None = Field(description="What runtime 'auto' means there; null: refused (no working bubblewrap, local not allowed).")
    isolation: dict[str, str] = Field(description="Runtime -> isolation: namespaces, container, none.")
    limit_enforcement: dict[str, str] = Field(description="Limit -> how the node enforces it (or why not).")
    capacity: int
    live: int
    heartbeat_at: float


class HealthResponse(BaseModel):
    ok: bool
    broker: str
    backend: str
    workers: dict[str, int] = Field(description="Queue -> number of workers consuming it.")
    worker_names: dict[str, list[str]]
    worker_threads: dict[str, dict[str, int]] = Field(default_factory=dict, description="Queue -> worker -> threads its pool holds (rollouts it can run at once).")
    threads: dict[str, int] = Field(default_factory=dict, description="Queue -> threads of all its workers together.")
    sandbox_hosts: list[SandboxHostHealth] = Field(default_factory=list, description="Live sandbox hosts.")
    store_shards: list[str] = Field(default_factory=list, description="Each store shard (PRORL_STORE_SHARDS, in order): \"ok\" or why it does not answer; empty without shards. One that does not answer makes ok false.")
    routing: str | None = Field(None, description="The LLM routing's own Redis (PRORL_ROUTING_URL): \"ok\" or why it does not answer; null when the head's Redis holds the routing. One that does not answer makes ok false.")


class GroupSubmitResponse(BaseModel):
    group_id: str
    job_ids: list[str]
    warnings: list[dict[str, Any]] | None = Field(None, description="As the jobs' submission's.")


class GroupSample(BaseModel):
    job_id: str
    status: str
    reward: float | None


class RewardStats(BaseModel):
    count: int
    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    all_equal: bool | None


class GroupView(BaseModel):
    group_id: str
    n: int
    complete: bool
    samples: list[GroupSample]
    counts: dict[str, int]
    rewards: RewardStats | None = Field(None, description="Present once every sample ended.")


class GroupCancelResponse(BaseModel):
    group_id: str
    cancelled: list[str]


class CancelAllResponse(BaseModel):
    cancelled: int
    job_ids: list[str]


class Completion(BaseModel):
    cursor: str
    job_id: str
    status: str
    group_id: str | None
    data_source: str
    project: str | None = None
    job: JobView | None


class CompletionsResponse(BaseModel):
    cursor: str = Field(description="Pass it back to continue after the last completion returned.")
    completions: list[Completion]


class CompatStatus(BaseModel):
    status: str
    pending_jobs: int
    running: int
    jobs: int
    init: int
    run: int
    eval: int
    counts: dict[str, int]


class CompatStartResponse(BaseModel):
    status: str


class CompatStopResponse(BaseModel):
    status: str
    cancelled: int


class CompatCancelResponse(BaseModel):
    job_id: str
    cancelled: bool
    status: str
    job_ids: list[str] = Field(default_factory=list, description="The jobs this call cancelled.")


class CompatResult(BaseModel):
    """Our result with the reference system's fields added."""

    model_config = ConfigDict(extra="allow")

    resolved: bool
    critical_error: str | None
    finish: bool
    messages: list[Any]
    timing: dict[str, Any]
    instance_id: str | None
    trajectory_id: int | None
    filter: bool
    git_patch: str
