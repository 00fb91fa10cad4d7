"""What ``POST /llm_servers`` checks before it registers a backend: that the server answers the
protocol and dialect it is registered with, a tool call when rollouts will send tools, and
exact token ids when the trainer needs them. A server that cannot is refused with a 400 naming
the flag it was started without, so the trainer learns it at registration, not from failed jobs.

The probe reads ``GET /v1/models`` (the model name; the context window from vLLM's
``max_model_len`` or llama.cpp's ``meta.n_ctx``), then sends one 1-token request.
"""
from __future__ import annotations

from typing import Any

from prorl_celery import http
from prorl_celery.errors import BackendFailed, ContextWindowExceeded, InvalidRequest, LLMError
from prorl_celery.llm import dialects
from prorl_celery.llm.models import BackendSpec, LLMRequest, Protocol, SamplingParams
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.transport import Call

PROBE_TIMEOUT_S = 60.0
PROBE_TOOL = {"type": "function", "function": {
    "name": "probe", "description": "registration probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
def probe_backend(spec: BackendSpec, address: str) -> dict[str, Any]:
    """The fields the server states (``model``, ``max_model_len``) that ``spec`` leaves open;
    raises InvalidRequest (a 400 naming the field and the missing flag) when it cannot serve."""
    listed = _models(spec, address)
    found: dict[str, Any] = {}
    if spec.model is None and listed.get("id"):
        found["model"] = listed["id"]
    if spec.max_model_len is None and listed.get("max_model_len"):
        found["max_model_len"] = listed["max_model_len"]
    slot = Slot.direct("probe", address, spec.protocol, spec.api_key, model=spec.model or found.get("model"),
                       max_model_len=spec.max_model_len or found.get("max_model_len"),
                       tokenizer=spec.tokenizer, dialect=spec.dialect, logprobs_mode=spec.logprobs_mode)
    tools = [PROBE_TOOL] if spec.tools and spec.protocol is Protocol.CHAT else None
    request = LLMRequest(messages=[{"role": "user", "content": "Say ok."}], tools=tools,
                         sampling=SamplingParams(max_tokens=1, temperature=0.0))
    turn = _one_token(slot, request, spec)
    if spec.exact_tokens and not turn.response_ids:
        raise _refused(spec, "exact_tokens", "the server returned no token ids for the generated tokens")
    return found


def _models(spec: BackendSpec, address: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    try:
        status, data = http.request_json("GET", f"{address}/v1/models", headers=headers, timeout=10)
        first = data["data"][0] if status == 200 else {}
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise InvalidRequest(f"address: {address}/v1/models did not answer ({type(exc).__name__}: {exc}); "
                             "register with probe false if the server is not up yet", field="address") from None
    if status == 404:  # no model list (NeMo Gym's model servers): the 1-token request decides
        return {"id": None, "max_model_len": None}
    if status != 200:
        raise InvalidRequest(f"address: GET {address}/v1/models -> {status}", field="address")
    meta = first.get("meta") if isinstance(first.get("meta"), dict) else {}
    limit = first.get("max_model_len") or meta.get("n_ctx")
    return {"id": first.get("id"), "max_model_len": int(limit) if isinstance(limit, int) and limit > 0 else None}


def _one_token(slot: Slot, request: LLMRequest, spec: BackendSpec) -> Any:
    from prorl_celery.llm.clients import client_for

    try:
        with Call(PROBE_TIMEOUT_S) as call:
            return client_for(slot.backend.protocol).generate(slot, request, call)
    except ContextWindowExceeded as exc:
        raise InvalidRequest(f"max_model_len: the probe's 1-token request does not fit: {exc}",
                             field="max_model_len") from None
    except (LLMError, BackendFailed) as exc:
        text = str(exc)
        field = "tools" if spec.tools and any(w in text.lower() for w in ("tool", "jinja")) else "dialect"
        raise _refused(spec, field, text) from None


def _refused(spec: BackendSpec, field: str, why: str) -> InvalidRequest:
    """The refusal, with what the server needs started as its dialect says (its probe hints)."""
    dialect = spec.dialect or (dialects.DEFAULT_CHAT if spec.protocol is Protocol.CHAT else None)
    flag = dialects.get(dialect).probe_hints.get(field) if dialect else None
    asked = {"tools": "tool calls", "exact_tokens": "exact token ids",
             "dialect": f"the {spec.protocol.value} protocol in dialect {dialect}"}[field]
    hint = f"; the server needs {flag}" if flag else ""
    return InvalidRequest(f"{field}: the server at {spec.address} cannot serve {asked}: {why}{hint}", field=field)
