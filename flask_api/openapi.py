"""``GET /openapi.json``: the whole API, built from the pydantic models of its bodies."""
from __future__ import annotations

from typing import Any

from flask import Blueprint, current_app, jsonify
from pydantic import BaseModel

from flask_api import schemas as s
from flask_api.compat import CancelRequest, ProcessRequest
from flask_api.groups import CancelAllRequest, GroupRequest
from prorl_celery.models import BatchRequest, JobRequest, JobView

bp = Blueprint("openapi", __name__)

# Other areas (the LLM backend endpoints) append their operations here at import time.
OPERATIONS: list[dict[str, Any]] = []


def operation(method: str, path: str, summary: str, responses: dict[int, type[BaseModel] | None],
              body: Any = None, query: dict[str, dict] | None = None, tag: str = "jobs") -> None:
    OPERATIONS.append({"method": method, "path": path, "summary": summary, "responses": responses,
                       "body": body, "query": query or {}, "tag": tag})


_JOB = {200: JobView, 404: s.ErrorBody}
_WAIT = {"type": "number", "minimum": 0}
operation("post", "/jobs", "Submit one job or a batch", {202: s.SubmitResponse, 400: s.ErrorBody},
          body=[JobRequest, BatchRequest])
operation("get", "/jobs/{job_id}", "A job's status, timings and result", _JOB)
operation("get", "/jobs/{job_id}/wait", "Wait for a job to end (202 if still running)",
          {**_JOB, 202: JobView, 400: s.ErrorBody}, query={"timeout": _WAIT})
operation("delete", "/jobs/{job_id}", "Cancel a job", {**_JOB, 409: s.ErrorBody})
operation("post", "/groups", "Submit n samples of one prompt", {202: s.GroupSubmitResponse, 400: s.ErrorBody},
          body=GroupRequest, tag="groups")
operation("get", "/groups/{group_id}", "Each sample's status; reward statistics once complete",
          {200: s.GroupView, 404: s.ErrorBody}, tag="groups")
operation("delete", "/groups/{group_id}", "Cancel a group", {200: s.GroupCancelResponse, 404: s.ErrorBody},
          tag="groups")
operation("post", "/cancel_all", "Cancel every active job (optionally of a group or data source)",
          {200: s.CancelAllResponse, 400: s.ErrorBody}, body=CancelAllRequest, tag="groups")
operation("get", "/completions", "Finished jobs after a cursor, in completion order (long poll)",
          {200: s.CompletionsResponse, 400: s.ErrorBody},
          query={"cursor": {"type": "string"}, "wait": _WAIT, "limit": {"type": "integer", "minimum": 1,
                                                                        "maximum": 5000},
                 "group_id": {"type": "string"}}, tag="stream")
operation("get", "/events", "Finished jobs as server-sent events; resumes from Last-Event-ID",
          {200: None, 400: s.ErrorBody}, query={"cursor": {"type": "string"}, "group_id": {"type": "string"}},
          tag="stream")
operation("get", "/metrics", "Prometheus metrics", {200: None}, tag="operations")
operation("get", "/openapi.json", "This document", {200: None}, tag="operations")
operation("get", "/healthz", "Broker, backend and workers per queue", {200: s.HealthResponse, 503: s.HealthResponse},
          tag="operations")
operation("post", "/start", "Reference API: start accepting /process", {200: s.CompatStartResponse, 400: s.ErrorBody},
          tag="reference")
operation("post", "/stop", "Reference API: stop, cancelling jobs started by /process",
          {200: s.CompatStopResponse}, tag="reference")
operation("get", "/status", "Reference API: counts of jobs", {200: s.CompatStatus}, tag="reference")
operation("post", "/process", "Reference API: run one rollout and answer with its result",
          {200: s.CompatResult, 400: s.ErrorBody, 504: s.ErrorBody}, body=ProcessRequest, tag="reference")
operation("post", "/cancel", "Reference API: cancel one job",
          {200: s.CompatCancelResponse, 400: s.ErrorBody, 404: s.ErrorBody}, body=CancelRequest, tag="reference")


def _ref(model: type[BaseModel], components: dict[str, Any]) -> dict[str, str]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components.setdefault(model.__name__, schema)
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def build_document(max_wait_s: float, token: bool) -> dict[str, Any]:
    components: dict[str, Any] = {}
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in ("job_id", "group_id", "backend_id") if "{" + name + "}" in op["path"]]
        for name, schema in op["query"].items():
            schema = dict(schema)
            if name in ("timeout", "wait"):
                schema["maximum"] = max_wait_s
            params.append({"name": name, "in": "query", "required": False, "schema": schema})
        entry: dict[str, Any] = {"summary": op["summary"], "tags": [op["tag"]], "parameters": params,
                                 "responses": {}}
        for status, model in op["responses"].items():
            described = {"description": model.__doc__.strip().splitlines()[0] if model and model.__doc__
                         else str(status)}
            if model is not None:
                described["content"] = _content(_ref(model, components))
            entry["responses"][str(status)] = described
        if op["body"] is not None:
            models = op["body"] if isinstance(op["body"], list) else [op["body"]]
            refs = [_ref(m, components) for m in models]
            entry["requestBody"] = {"required": True,
                                    "content": _content(refs[0] if len(refs) == 1 else {"oneOf": refs})}
        if token and op["path"] != "/healthz":
            entry["responses"]["401"] = {"description": "missing or wrong token",
                                         "content": _content(_ref(s.ErrorBody, components))}
        paths.setdefault(op["path"], {})[op["method"]] = entry
    doc = {"openapi": "3.0.3",
           "info": {"title": "prorl-celery", "version": "0.1.0",
                    "description": "Rollout-as-a-service for RL training of multi-turn LLM agents."},
           "paths": paths, "components": {"schemas": components}}
    if token:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


@bp.get("/openapi.json")
def openapi():
    config = current_app.config
    return jsonify(build_document(config["WAIT_MAX_S"], bool(config.get("API_TOKEN"))))
