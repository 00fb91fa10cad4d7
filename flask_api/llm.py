"""LLM backends: register, list, remove, drain and resume (checkpoint swaps); and the reference
system's ``/add_llm_server`` and ``/clear_llm_server``."""
from __future__ import annotations

import logging

from flask import Blueprint, current_app, jsonify
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from flask_api.errors import parse_body
from flask_api.routes import route
from flask_api.schemas import ErrorBody
from flask_api.tenancy import (backend_visible, caller, check_backend_address, check_backend_control, controlled_ids,
                               visible_backend)
from prorl_celery.errors import BackendFailed
from prorl_celery.llm.control import drain, resume
from prorl_celery.llm.models import Backend, BackendSpec, PauseApi
from prorl_celery.llm.pause import name_version
from prorl_celery.llm.probe import probe_backend
from prorl_celery.llm.registry import BackendRegistry, normalize_address
from prorl_celery.staleness import WeightVersions

bp = Blueprint("llm", __name__)
log = logging.getLogger(__name__)


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ids: list[str] | None = Field(None, description="Backends to drain; default: all.")
    wait: float = Field(60.0, ge=0, description="Seconds to wait for their in-flight requests to end.")
    abort: bool = Field(False, description="Abort their in-flight requests (the rollouts retry them).")


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    ids: list[str] | None = Field(None, validation_alias=AliasChoices("ids", "backends"),
                                  description="Backends to resume (also accepted as 'backends'); default: all.")
    weight_version: str | None = Field(None, min_length=1, max_length=200,
                                       description="The weight version they serve now (the current one for the "
                                                   "staleness bound; paused servers are told it, then resumed).")


class AddServerRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    address: str


class AddServerResponse(BaseModel):
    """The backend's id; 201 if it is new, 200 if the address was already registered."""

    id: str
    created: bool
    backend: Backend


class BackendList(BaseModel):
    """Every registered backend with its status and live counters."""

    backends: list[Backend]


class RemoveResponse(BaseModel):
    """The backend is gone; its in-flight requests retry elsewhere."""

    removed: str


class DrainResponse(BaseModel):
    """Whether nothing is in flight on the drained backends any more, and their counts."""

    drained: bool
    in_flight: dict[str, int]
    aborted: dict[str, int]
    backends: list[Backend]


class ResumeResponse(BaseModel):
    """The backends back in rotation."""

    resumed: list[str]
    backends: list[Backend]


class CompatAddResponse(BaseModel):
    """Reference API: registered (duplicates are one backend)."""

    status: str
    id: str
    created: bool


class CompatClearResponse(BaseModel):
    """Reference API: every backend removed."""

    status: str
    removed: list[str]


_BAD = {400: ErrorBody}


def _registry() -> BackendRegistry:
    return BackendRegistry(current_app.extensions["prorl_store"].redis)


@route(bp, "post", "/llm_servers", "Register an LLM backend (the same address twice is one backend)",
       {201: AddServerResponse, 200: AddServerResponse, 403: ErrorBody, **_BAD}, body=BackendSpec, tag="llm")
def add_server():
    spec: BackendSpec = parse_body(BackendSpec)
    check_backend_address(normalize_address(spec.address))
    if spec.probe:  # a server that cannot do what was asked is refused now, naming the missing flag
        found = probe_backend(spec, normalize_address(spec.address))
        spec = spec.model_copy(update=found)
    registry = _registry()
    backend, created = registry.add(spec, project=caller())
    if backend.weight_version:
        WeightVersions(registry.head, backend.project).know(backend.weight_version)
        if backend.pause_api not in (None, PauseApi.NONE) and spec.probe:
            try:  # its spans then say this name, not the last one it was told (or "default")
                name_version(backend, backend.weight_version, registry.api_key(backend.id))
            except BackendFailed as exc:
                log.warning("backend %s: could not name its weight version: %s", backend.id, exc)
    return jsonify({"id": backend.id, "created": created, "backend": backend.public()}), 201 if created else 200


@route(bp, "get", "/llm_servers", "LLM backends: status, capacity, in flight, served, failures, weights "
       "(a project's key: the shared ones and its own)", {200: BackendList}, tag="llm")
def list_servers():
    return jsonify({"backends": [b.public() for b in _registry().list() if backend_visible(b)]})


@route(bp, "get", "/llm_servers/{backend_id}", "One LLM backend", {200: Backend, 404: ErrorBody}, tag="llm")
def get_server(backend_id: str):
    return jsonify(visible_backend(_registry().get(backend_id)).public())


@route(bp, "delete", "/llm_servers/{backend_id}", "Remove an LLM backend (in-flight requests retry elsewhere)",
       {200: RemoveResponse, 403: ErrorBody, 404: ErrorBody}, tag="llm")
def remove_server(backend_id: str):
    registry = _registry()
    check_backend_control(registry.get(backend_id))
    registry.remove(backend_id)
    return jsonify({"removed": backend_id})


@route(bp, "post", "/llm_servers/drain", "Stop new requests to backends and wait for their in-flight ones",
       {200: DrainResponse, 403: ErrorBody, 404: ErrorBody, **_BAD}, body=DrainRequest, tag="llm")
def drain_servers():
    body: DrainRequest = parse_body(DrainRequest)
    registry = _registry()
    wait = min(body.wait, current_app.config.get("WAIT_MAX_S", 600.0))
    outcome = drain(registry, controlled_ids(registry, body.ids), wait, body.abort)
    return jsonify({**outcome, "backends": [b.public() for b in registry.get_many(outcome["in_flight"])]})


@route(bp, "post", "/llm_servers/resume", "Put backends back in rotation, with a new weight version",
       {200: ResumeResponse, 403: ErrorBody, 404: ErrorBody, **_BAD}, body=ResumeRequest, tag="llm")
def resume_servers():
    body: ResumeRequest = parse_body(ResumeRequest)
    registry = _registry()
    ids = resume(registry, controlled_ids(registry, body.ids), body.weight_version, project=caller())
    return jsonify({"resumed": ids, "backends": [b.public() for b in registry.get_many(ids)]})


@route(bp, "post", "/add_llm_server", "Reference API: register an LLM server",
       {200: CompatAddResponse, 403: ErrorBody, **_BAD},
       body=AddServerRequest, tag="reference")
def add_llm_server():
    """Reference-compatible: register an OpenAI-compatible server; duplicates are one backend."""
    body: AddServerRequest = parse_body(AddServerRequest)
    check_backend_address(normalize_address(body.address))
    backend, created = _registry().add(BackendSpec(address=body.address), project=caller())
    return jsonify({"status": "ok", "id": backend.id, "created": created})


@route(bp, "post", "/clear_llm_server", "Reference API: remove every LLM server (a project's key: its own)",
       {200: CompatClearResponse}, tag="reference")
def clear_llm_server():
    """Reference-compatible: forget every backend (their in-flight requests retry elsewhere); a
    project forgets only its private ones."""
    registry = _registry()
    return jsonify({"status": "ok", "removed": registry.clear(controlled_ids(registry, None))})
