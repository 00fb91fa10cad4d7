"""The client interface (one implementation per backend protocol) and what they share: the POST
that turns HTTP outcomes into the pool's exceptions, and model-name discovery. What differs per
server (the body, the sampling names, the answer's reading) is its dialect's
(:mod:`prorl_celery.llm.dialects`)."""
from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any, Protocol as TypingProtocol

from prorl_celery import http, jsonfast
from prorl_celery.errors import BackendFailed, ContextWindowExceeded, LLMRequestRejected
from prorl_celery.llm.models import LLMRequest, Turn
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.transport import Call, open_stream, request_json

# vLLM: "This model's maximum context length is N tokens ..."; SGLang: "... longer than the
# model's context length ..."; OpenAI: "context_length_exceeded"; llama.cpp: "request (N tokens)
# exceeds the available context size (M tokens)", type exceed_context_size_error.
_CONTEXT_RE = re.compile(r"maximum context length|context length|context_length_exceeded|context window|"
                         r"context size|maximum model length", re.I)
# A server started without what the request needs answers with the flag to add (vLLM: 400
# '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'; llama.cpp: 500
# "tools param requires --jinja flag"): the request's fault, not the backend's health.
_MISSING_FLAG_RE = re.compile(r"requires --|--jinja|--enable-auto-tool-choice|--tool-call-parser", re.I)


class Client(TypingProtocol):
    """Generates one turn on the backend of ``slot``; raises the pool's exceptions."""

    def generate(self, slot: Slot, request: LLMRequest, call: Call) -> Turn: ...


def headers(slot: Slot) -> dict[str, str]:
    return {"Authorization": f"Bearer {slot.api_key}"} if slot.api_key else {}


def post(slot: Slot, path: str, body: dict[str, Any], call: Call) -> dict[str, Any]:
    """POST ``body`` to the backend; the JSON answer, or BackendFailed (connection, 5xx, 429),
    ContextWindowExceeded, LLMRequestRejected (other 4xx). Aborts raise CallAborted."""
    url = slot.backend.address + path
    try:
        status, data = request_json(call, "POST", url, body, headers(slot))
    except OSError as exc:
        raise BackendFailed(f"{url}: {type(exc).__name__}: {exc}") from None
    if status == 200 and isinstance(data, dict):
        return data
    raise_for_answer(url, status, data)
    raise AssertionError("unreachable")


def post_events(slot: Slot, path: str, body: dict[str, Any], call: Call) -> Iterator[dict[str, Any]]:
    """POST ``body`` for server-sent events: each ``data:`` line's JSON as it arrives (a server
    that answered with one JSON document instead: that document). Errors as :func:`post`; a
    stream the peer broke: BackendFailed; one an abort cut (the call's socket is shut down while
    it is read): CallAborted, raised when the reading ends, so the caller keeps what came before."""
    url = slot.backend.address + path
    try:
        resp = open_stream(call, url, body, headers(slot))
    except OSError as exc:
        raise BackendFailed(f"{url}: {type(exc).__name__}: {exc}") from None
    try:
        with resp:
            if resp.status_code != 200 or "text/event-stream" not in (resp.header("Content-Type") or ""):
                try:
                    data = resp.json() if resp.content else None
                except ValueError:
                    data = resp.text
                if resp.status_code == 200 and isinstance(data, dict):
                    yield data
                    return
                raise_for_answer(url, resp.status_code, data)
            try:
                for line in resp.iter_lines():
                    if line.startswith(b"data:"):
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            return
                        yield jsonfast.loads(payload)
            except OSError as exc:
                call.check()
                raise BackendFailed(f"{url}: the stream broke: {type(exc).__name__}: {exc}") from None
            call.check()  # the stream ended because an abort shut it down
    finally:
        call.attach(None)


def raise_for_answer(url: str, status: int, data: Any) -> None:
    """The pool's exception for an answer that is not a usable 200 (see :func:`post`)."""
    message = _error_message(data)
    if status != 200 and _MISSING_FLAG_RE.search(message):
        raise LLMRequestRejected(f"{url} -> {status}: {message} (restart the server with the "
                                 "flag it names, or register it without tools)")
    if status >= 500 or status == 429 or status == 200:
        raise BackendFailed(f"{url} -> {status}: {message}")
    if _CONTEXT_RE.search(message):
        raise ContextWindowExceeded(message)
    raise LLMRequestRejected(f"{url} -> {status}: {message}")


def _error_message(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:1000]
        return str(data.get("detail") or data.get("message") or err)[:1000]
    return str(data)[:1000]


_models: dict[str, str] = {}
_models_lock = threading.Lock()


# The model name sent to a server that has no GET /v1/models and was registered without a model.
UNLISTED_MODEL = "default"


def model_name(slot: Slot, request: LLMRequest) -> str:
    """The request's model, else the backend's registered one, else the first of its /v1/models."""
    if request.model or slot.backend.model:
        return request.model or slot.backend.model  # type: ignore[return-value]
    with _models_lock:
        if slot.backend.address in _models:
            return _models[slot.backend.address]
    try:
        status, data = http.request_json("GET", f"{slot.backend.address}/v1/models", headers=headers(slot), timeout=10)
        if status == 404:  # lists no models (NeMo Gym's model servers pick their own)
            name = UNLISTED_MODEL
        elif status != 200:
            raise ValueError(f"status {status}")
        else:
            name = data["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BackendFailed(f"{slot.backend.address}/v1/models: {type(exc).__name__}: {exc}") from None
    with _models_lock:
        _models[slot.backend.address] = name
    return name
