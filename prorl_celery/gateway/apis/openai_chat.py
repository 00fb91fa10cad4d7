"""OpenAI chat completions: ``POST /v1/chat/completions`` (plain and ``stream``)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from prorl_celery.gateway.apis.base import (Failure, bad_request, function_tool, new_id, now, rendered, require,
                                            sampling_fields, sse)
from prorl_celery.gateway.models import GatewayRequest
from prorl_celery.llm.models import SamplingParams, Turn

ROLES = {"system", "developer", "user", "assistant", "tool"}
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "seed": "seed", "stop": "stop", "tool_choice": "tool_choice",
            # never honoured (only the trainer sets these): read to be named as dropped
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "logit_bias": "logit_bias"}
ERROR_TYPES = {"invalid_request": "invalid_request_error", "context_length": "invalid_request_error",
               "budget": "insufficient_quota", "rate_limited": "rate_limit_exceeded",
               "too_large": "invalid_request_error",
               "auth": "authentication_error", "not_found": "not_found_error",
               "cancelled": "server_error", "unavailable": "server_error", "timeout": "timeout",
               "internal": "server_error"}


class OpenAIChat:
    name = "openai_chat"
    routes = (("POST", "/v1/chat/completions"), ("POST", "/chat/completions"))

    def parse(self, body: Any) -> GatewayRequest:
        require(isinstance(body, dict), "the body must be a JSON object")
        out = _messages(body.get("messages"))
        tools = _tools(body.get("tools"))
        require(body.get("n") in (None, 1), "n: only 1 is supported", "n")
        sampling = _sampling(body)
        return GatewayRequest(messages=out, tools=tools or None, sampling=sampling, model=body.get("model"),
                              stream=bool(body.get("stream")))

    def _message(self, turn: Turn) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": turn.content or None}
        if turn.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in turn.tool_calls]
        return message

    @staticmethod
    def _finish(turn: Turn) -> str:
        if turn.tool_calls:
            return "tool_calls"
        return "length" if turn.finish_reason == "length" else "stop"

    @staticmethod
    def _usage(turn: Turn) -> dict[str, int]:
        p, c = len(turn.prompt_ids or []), len(turn.response_ids or [])
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def respond(self, turn: Turn, request: GatewayRequest) -> dict[str, Any]:
        return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": now(),
                "model": request.model or turn.model,
                "choices": [{"index": 0, "message": self._message(turn), "logprobs": None,
                             "finish_reason": self._finish(turn)}],
                "usage": self._usage(turn)}

    def stream(self, turn: Turn, request: GatewayRequest) -> Iterator[bytes]:
        head = {"id": new_id("chatcmpl-"), "object": "chat.completion.chunk", "created": now(),
                "model": request.model or turn.model}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return sse(json.dumps({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                         "finish_reason": finish}]}))

        yield chunk({"role": "assistant", "content": ""})
        if turn.content:
            yield chunk({"content": turn.content})
        for i, call in enumerate(turn.tool_calls):
            yield chunk({"tool_calls": [{"index": i, **call.to_openai()}]})
        yield chunk({}, self._finish(turn))
        yield sse(json.dumps({**head, "choices": [], "usage": self._usage(turn)}))
        yield sse("[DONE]")

    def error(self, failure: Failure) -> tuple[int, dict[str, Any]]:
        code = "context_length_exceeded" if failure.kind == "context_length" else failure.kind
        return failure.status, {"error": {"message": failure.message, "type": ERROR_TYPES.get(failure.kind, "error"),
                                          "param": failure.param, "code": code}}


def _messages(messages: Any) -> list[dict[str, Any]]:
    """The request's messages, each checked and rendered (a ``developer`` message as ``system``)."""
    require(isinstance(messages, list) and messages, "messages: a non-empty list is required", "messages")
    out = []
    for i, message in enumerate(messages):
        require(isinstance(message, dict) and message.get("role") in ROLES,
                f"messages[{i}]: an object with a role of {sorted(ROLES)}", f"messages[{i}]")
        out.append(rendered(message if message["role"] != "developer" else {**message, "role": "system"},
                            f"messages[{i}]"))
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    """The request's function tools (a tool's ``function`` object, or the tool itself)."""
    require(tools is None or isinstance(tools, list) and all(isinstance(t, dict) for t in tools),
            "tools: a list of function tools", "tools")
    return [function_tool(t.get("function") if isinstance(t.get("function"), dict) else t, f"tools[{i}]")
            for i, t in enumerate(tools or [])]


def _sampling(body: dict[str, Any]) -> SamplingParams:
    """The sampling fields the request sent (``max_completion_tokens`` or ``max_tokens`` as ``max_tokens``)."""
    params = sampling_fields(body, SAMPLING)
    cap = body.get("max_completion_tokens") or body.get("max_tokens")
    if cap is not None:
        params["max_tokens"] = cap
    try:
        return SamplingParams.model_validate(params)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise bad_request(f"{'.'.join(map(str, err['loc']))}: {err['msg']}", str(err["loc"][0])) from None
