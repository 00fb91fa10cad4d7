"""Pydantic models on the service's boundaries: submissions, job records, results."""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from prorl_celery.status import JobStatus

CriticalError = Literal["init", "run", "eval", "timeout", "sandbox", "llm", "cancelled"]
_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


def _check_id(value: str | None) -> str | None:
    if value is not None and not _ID.match(value):
        raise ValueError("must be 1-128 characters of letters, digits, '_', '-', '.'")
    return value


class JobRequest(BaseModel):
    """One rollout as a trainer submits it."""

    model_config = ConfigDict(extra="forbid")

    instance: dict[str, Any] = Field(description="The task; its data_source picks the handler.")
    sampling_params: dict[str, Any] = Field(default_factory=dict,
                                            description="Agent and LLM parameters for this rollout.")
    job_id: str | None = Field(None, description="Client-chosen id; a known id is not run again.")
    group_id: str | None = Field(None, description="Jobs sharing a group id can be cancelled together.")

    _ids = field_validator("job_id", "group_id")(classmethod(lambda cls, v: _check_id(v)))

    @field_validator("sampling_params")
    @classmethod
    def _budgets_are_positive(cls, value: dict[str, Any]) -> dict[str, Any]:
        for stage in ("init", "run", "eval"):
            budget = value.get(f"{stage}_budget_s")
            if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                       or budget <= 0):
                raise PydanticCustomError("budget", "{field} must be a positive number of seconds",
                                          {"field": f"{stage}_budget_s", "loc": f"{stage}_budget_s"})
        return value

    @field_validator("instance")
    @classmethod
    def _has_data_source(cls, value: dict[str, Any]) -> dict[str, Any]:
        source = value.get("data_source")
        if not isinstance(source, str) or not source:
            raise ValueError("instance.data_source must be a non-empty string naming the handler")
        return value


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


class JobView(BaseModel):
    """A job as the API shows it."""

    job_id: str
    status: JobStatus
    stage: str | None
    group_id: str | None = None
    data_source: str
    timings: Timings
    workers: dict[str, str] = Field(default_factory=dict, description="Stage -> worker that ran it.")
    attempts: dict[str, int] = Field(default_factory=dict, description="Stage -> times it was started.")
    result: JobResult | None = None
