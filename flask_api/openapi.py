"""``GET /openapi.json``: the whole API, built from the pydantic models of its bodies."""
from __future__ import annotations

from typing import Any

from flask import Blueprint, current_app, jsonify
from pydantic import BaseModel

from flask_api import schemas as s
from flask_api.routes import OPERATIONS, route

bp = Blueprint("openapi", __name__)


def _ref(model: type[BaseModel], components: dict[str, Any]) -> dict[str, str]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components.setdefault(model.__name__, schema)
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def build_document(max_wait_s: float, token: bool) -> dict[str, Any]:
    from flask_api import compat, groups, health, jobs, llm, metrics, stream  # noqa: F401 - their route()s fill OPERATIONS

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
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer", "description": (
            "The operator's token (PRORL_API_TOKEN: everything) or a project's key (`prorl-celery projects add`: "
            "its own jobs, groups, completions and backends; others' answer 404 as unknown ids)")}}
        doc["security"] = [{"bearer": []}]
    return doc


@route(bp, "get", "/openapi.json", "This document", {200: None}, tag="operations")
def openapi():
    config = current_app.config
    return jsonify(build_document(config["WAIT_MAX_S"], bool(config.get("API_TOKEN"))))
