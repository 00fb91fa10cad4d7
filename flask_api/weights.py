"""Weight updates under running rollouts: pause backends (keep | abort | drain) until it is safe
to write weights, acknowledge consumed results (the staleness bound's "consumed"), and read the
versions' state. Resume is ``POST /llm_servers/resume`` (flask_api/llm.py)."""
from __future__ import annotations

from typing import Literal

from flask import Blueprint, current_app, jsonify
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from flask_api.errors import parse_body
from flask_api.routes import route
from flask_api.schemas import ErrorBody
from flask_api.tenancy import caller, controlled_ids, ids_by_owner
from prorl_celery.llm.control import pause
from prorl_celery.llm.registry import BackendRegistry
from prorl_celery.staleness import WeightVersions

bp = Blueprint("weights", __name__)


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    mode: Literal["keep", "abort", "drain"] = Field(
        "keep", description="keep: the server freezes its turns in place (where it can: a pause API and answers with "
                            "per-token versions); abort: the server ends them with their tokens so far and each turn "
                            "goes on from them after resume; drain: wait for them. Each backend falls back from keep "
                            "to abort to drain as it must.")
    ids: list[str] | None = Field(None, validation_alias=AliasChoices("backends", "ids"),
                                  description="Backends to pause (also accepted as 'backends'); default: all.")
    wait: float = Field(60.0, ge=0, description="Seconds to wait for drained backends' requests to end.")
    max_pause_s: float | None = Field(None, ge=1, description="Seconds the pause holds if no resume comes; then the "
                                                              "backends resume on the weight version they had. At most "
                                                              "the operator's PRORL_LLM_MAX_PAUSE_S (default: that).")


class PauseResponse(BaseModel):
    """Whether weights may be written now, how long the pause took, and what each backend did."""

    safe: bool
    pause_s: float
    modes: dict[str, str]
    server_s: dict[str, float]
    in_flight: dict[str, int]
    errors: dict[str, str]
    max_pause_s: float = Field(description="How long the pause holds with no resume (the operator's limit applied).")
    expires_at: float = Field(description="When it expires (unix time) if no resume comes.")


class AckRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_ids: list[str] = Field(min_length=1, max_length=100000,
                               description="Results the trainer has consumed (read into a batch).")


class WeightsState(BaseModel):
    """The current weight version's ordinal and the oldest unconsumed rollout's."""

    current: int
    oldest_unconsumed: int | None
    unconsumed: int
    acked: int | None = None


def _versions(project: str | None = None) -> WeightVersions:
    return WeightVersions(current_app.extensions["prorl_store"].redis, project or caller())


def _state(acked: int | None = None) -> dict:
    versions = _versions()
    return {"current": versions.current(), "oldest_unconsumed": versions.oldest_unconsumed(),
            "unconsumed": versions.unconsumed(), "acked": acked}


@route(bp, "post", "/llm_servers/pause", "Pause backends for a weight update; returns when it is safe to write",
       {200: PauseResponse, 403: ErrorBody, 404: ErrorBody, 400: ErrorBody}, body=PauseRequest, tag="llm")
def pause_servers():
    body: PauseRequest = parse_body(PauseRequest)
    registry = BackendRegistry(current_app.extensions["prorl_store"].redis)
    wait = min(body.wait, current_app.config.get("WAIT_MAX_S", 600.0))
    ids = controlled_ids(registry, body.ids)
    return jsonify(pause(registry, ids, body.mode, wait, max_pause_s=body.max_pause_s))


@route(bp, "post", "/jobs/ack", "Acknowledge consumed results (they stop holding back admission)",
       {200: WeightsState, 400: ErrorBody}, body=AckRequest, tag="jobs")
def ack_jobs():
    body: AckRequest = parse_body(AckRequest)
    owners = ids_by_owner(current_app.extensions["prorl_store"], body.job_ids)
    return jsonify(_state(sum(_versions(owner).consume(ids) for owner, ids in owners.items())))


@route(bp, "get", "/weights", "Weight versions (the caller's project's): the current one and the oldest unconsumed "
       "rollout's",
       {200: WeightsState}, tag="llm")
def weights_state():
    return jsonify(_state())
