"""The client interface (one implementation per backend protocol) and what they share: the POST
that turns HTTP outcomes into the pool's exceptions, and model-name discovery."""
from __future__ import annotations

import http.client
import re
import threading
from typing import Any, Protocol as TypingProtocol

import requests

from prorl_celery.errors import BackendFailed, ContextWindowExceeded, LLMRequestRejected
from prorl_celery.llm.models import LLMRequest, Turn
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.transport import Call, request_json

# vLLM: "This model's maximum context length is N tokens ..."; SGLang: "... longer than the
# model's context length ..."; OpenAI: "context_length_exceeded".
_CONTEXT_RE = re.compile(r"maximum context length|context length|context_length_exceeded|context window",
                         re.I)


class Client(TypingProtocol):
    """Generates one turn on the backend of ``slot``; raises the pool's exceptions."""

    def generate(self, slot: Slot, request: LLMRequest, call: Call) -> Turn: ...


def headers(slot: Slot) -> dict[str, str]:
    return {"Authorization": f"Bearer {slot.api_key}"} if slot.api_key else {}


def post(slot: Slot, path: str, body: dict[str, Any], call: Call) -> dict[str, Any]:
    """POST ``body`` to the backend; the JSON answer, or BackendFailed (connection, 5xx, 429),
    ContextWindowExceeded, LLMRequestRejected (other 4xx). Aborts raise CallAborted."""
    try:
        status, data = request_json(call, "POST", slot.address + path, body, headers(slot))
    except (OSError, http.client.HTTPException) as exc:
        raise BackendFailed(f"{slot.address}{path}: {type(exc).__name__}: {exc}") from None
    if status == 200 and isinstance(data, dict):
        return data
    message = _error_message(data)
    if status >= 500 or status == 429 or status == 200:
        raise BackendFailed(f"{slot.address}{path} -> {status}: {message}")
    if _CONTEXT_RE.search(message):
        raise ContextWindowExceeded(message)
    raise LLMRequestRejected(f"{slot.address}{path} -> {status}: {message}")


def _error_message(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:1000]
        return str(data.get("detail") or data.get("message") or err)[:1000]
    return str(data)[:1000]


_models: dict[str, str] = {}
_models_lock = threading.Lock()


def model_name(slot: Slot, request: LLMRequest) -> str:
    """The request's model, else the backend's registered one, else the first of its /v1/models."""
    if request.model or slot.model:
        return request.model or slot.model  # type: ignore[return-value]
    with _models_lock:
        if slot.address in _models:
            return _models[slot.address]
    try:
        resp = requests.get(f"{slot.address}/v1/models", headers=headers(slot), timeout=10)
        resp.raise_for_status()
        name = resp.json()["data"][0]["id"]
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        raise BackendFailed(f"{slot.address}/v1/models: {type(exc).__name__}: {exc}") from None
    with _models_lock:
        _models[slot.address] = name
    return name


def sampling_body(request: LLMRequest) -> dict[str, Any]:
    return request.sampling.model_dump(exclude_none=True)
