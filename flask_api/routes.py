"""One statement per endpoint: :func:`route` registers a view on its blueprint and records the
operation the OpenAPI document is built from, so the routes are described once, beside their code."""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from flask import Blueprint
from pydantic import BaseModel

OPERATIONS: list[dict[str, Any]] = []
WAIT_SECONDS = {"type": "number", "minimum": 0}  # the document caps it at the API's longest wait


def flask_rule(path: str) -> str:
    """``/jobs/{job_id}`` (OpenAPI) -> ``/jobs/<job_id>`` (Flask)."""
    return re.sub(r"\{(\w+)\}", r"<\1>", path)


def route(bp: Blueprint, method: str, path: str, summary: str, responses: dict[int, type[BaseModel] | None],
          body: Any = None, query: dict[str, dict] | None = None, tag: str = "jobs") -> Callable:
    """Decorator: serve the view at ``method path`` on ``bp`` and document it (``responses``: status ->
    body model, None for a body that is not JSON; ``body``: the request model or a list of them;
    ``query``: parameter name -> JSON schema)."""
    def register(view: Callable) -> Callable:
        OPERATIONS.append({"method": method, "path": path, "summary": summary, "responses": responses,
                           "body": body, "query": query or {}, "tag": tag})
        bp.add_url_rule(flask_rule(path), view_func=view, methods=[method.upper()])
        return view
    return register
