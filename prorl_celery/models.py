"""Pydantic models on the service's boundaries: submissions, job records, results."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from prorl_celery.status import JobStatus

CriticalError = Literal["init", "run", "eval", "timeout", "sandbox", "llm", "cancelled"]
ID_PATTERN = r"^[A-Za-z0-9_.\-]{1,128}$"


def _has_data_source(value: dict[str, Any]) -> dict[str, Any]:
    source = value.get("data_source")
    if not isinstance(source, str) or not source:
        raise ValueError("instance.data_source must be a non-empty string naming the handler")
    return value


def _budgets_are_positive(value: dict[str, Any]) -> dict[str, Any]:
    for stage in ("init", "run", "eval"):
        budget = value.get(f"{stage}_budget_s")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
            raise PydanticCustomError("budget", "{field} must be a positive number of seconds",
                                      {"field": f"{stage}_budget_s", "loc": f"{stage}_budget_s"})
    return value


def _staleness_is_a_bound(value: dict[str, Any]) -> dict[str, Any]:
    """``max_staleness``: an integer >= 0, or null (no bound); checked at submission, not when the
    run stage starts. Whether the operator's bound allows it is the API's check
    (:func:`prorl_celery.staleness.check_max_staleness`)."""
    k = value.get("max_staleness")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise PydanticCustomError("max_staleness", "max_staleness must be an integer >= 0 or null, not {value!r}",
                                  {"value": k, "loc": "max_staleness"})
    return value


Instance = Annotated[dict[str, Any], AfterValidator(_has_data_source), Field(
    description="The task; its data_source picks the handler.",
    json_schema_extra={"required": ["data_source"],
                       "properties": {"data_source": {"type": "string", "minLength": 1}}})]
SamplingParams = Annotated[dict[str, Any], AfterValidator(_budgets_are_positive), AfterValidator(_staleness_is_a_bound), Field(
    description="Agent and LLM parameters; init_budget_s / run_budget_s / eval_budget_s override the budgets.")]
JobId = Annotated[str, Field(pattern=ID_PATTERN, description="1-128 letters, digits, '_', '-', '.'")]


class JobRequest(BaseModel):
    """One rollout as a trainer submits it."""

    model_config = ConfigDict(extra="forbid")

    instance: Instance
    sampling_params: SamplingParams = Field(default_factory=dict)
    job_id: JobId | None = Field(None, description="Client-chosen id, an idempotency key: the same request under a known id is not run again; a different one is refused (409 job_id_conflict).")
    group_id: JobId | None = Field(None, description="Jobs sharing a group id can be cancelled together.")
    priority: int = Field(0, ge=-1000, le=1000, description="Within its project: a higher one is released to the stages first (evaluation before training); equal ones in order of submission. The operator's own jobs are not ordered by it.")


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jobs: list[JobRequest] = Field(min_length=1, max_length=10000)


class ErrorInfo(BaseModel):
    type: str
    message: str


class Timings(BaseModel):
    """Seconds. ``queue`` is time spent waiting for a worker; it is measured, not charged."""

    queue: float = 0.0
    init: float = 0.0
    run: float = 0.0
    eval: float = 0.0
    total: float = 0.0
    llm: float = Field(0.0, description="Waiting for the policy model (within run).")
    actions: float = Field(0.0, description="Running tool calls in the sandbox (within run).")
    init_wait: float = Field(0.0, description="Waiting for a sandbox (within init): every host "
                             "full, a transient create failure, an image still being pulled.")
    quota_wait: float = Field(0.0, description="Held by one of its project's quotas before it was released "
                              "to the stages (within queue); quota_held names which.")
    quota_held: str | None = Field(None, description="The quota that held it (max_in_flight, max_sandboxes), if any.")


class Attempt(BaseModel):
    """One run of a job from init. Every attempt but the last ended with an infrastructure fault
    (its sandbox host died, its worker was lost past the stage's deliveries, an LLM outage
    outlasted the retry budget) and the job ran again from init."""

    attempt: int = Field(description="1 for the first run from init.")
    stage: str | None = Field(None, description="Stage the attempt was in when it ended.")
    fault: str | None = Field(None, description="Error type that ended it; null for a completed one.")
    message: str = ""
    host: str | None = Field(None, description="Sandbox host of the attempt's sandbox, if it had one.")


class JobResult(BaseModel):
    """What the trainer gets back for every job, whatever happened to it.

    Domain handlers add their own fields (``steps``, ``git_patch``, ``answer`` ...).
    """

    model_config = ConfigDict(extra="allow")

    job_id: str
    status: JobStatus
    reward: float = 0.0
    resolved: bool = False
    critical_error: CriticalError | None = None
    filter: bool = Field(False, description="True when the trainer should drop this sample.")
    finish_reason: str | None = None
    error: ErrorInfo | None = None
    timing: Timings = Field(default_factory=Timings)
    instance_id: str | None = None
    trajectory_id: int | None = None
    attempts: list[Attempt] = Field(default_factory=list, description="Every run from init, in order.")
    cost: dict[str, Any] | None = Field(None, description="What it cost (prorl_celery/rollout/cost.py): tokens and "
                                                          "LLM seconds per backend, wall seconds per stage.")


class JobView(BaseModel):
    """A job as the API shows it."""

    job_id: str
    status: JobStatus
    stage: str | None
    group_id: str | None = None
    project: str | None = Field(None, description="The project whose key submitted it (None: the operator's token).")
    data_source: str
    timings: Timings
    workers: dict[str, str] = Field(default_factory=dict, description="Stage -> worker that ran it.")
    attempts: dict[str, int] = Field(default_factory=dict, description="Stage -> times it was started.")
    result: JobResult | None = None
