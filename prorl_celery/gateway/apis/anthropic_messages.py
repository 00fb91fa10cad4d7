"""Anthropic Messages: ``POST /v1/messages`` (plain and ``stream``) and
``POST /v1/messages/count_tokens``. Content blocks map to OpenAI chat messages and back: ``text``
to content, ``tool_use`` to a tool call (its ``input`` as the arguments), each ``tool_result`` to a
``tool`` message; ``thinking`` blocks are dropped (the chat template renders none), an ``image``
becomes a placeholder text."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from prorl_celery.gateway.apis.base import Failure, bad_request, new_id, require, sampling_fields, sse, text
from prorl_celery.gateway.models import GatewayRequest
from prorl_celery.llm.models import SamplingParams, Turn

SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop": "stop_sequences",
            "max_tokens": "max_tokens"}
ERROR_TYPES = {"invalid_request": "invalid_request_error", "context_length": "invalid_request_error",
               "budget": "permission_error", "rate_limited": "rate_limit_error", "too_large": "request_too_large",
               "auth": "authentication_error", "not_found": "not_found_error",
               "cancelled": "api_error", "unavailable": "overloaded_error", "timeout": "api_error",
               "internal": "api_error"}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict) and block.get("type") == "image":
            parts.append("[image]")
    return "".join(parts)


def _system(system: Any) -> list[dict[str, Any]]:
    said = _text(system) if system else ""
    return [{"role": "system", "content": said}] if said else []


def _user(content: Any, i: int) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    require(isinstance(content, list), f"messages[{i}].content: a string or a list of blocks", f"messages[{i}]")
    out = [{"role": "tool", "tool_call_id": text(b.get("tool_use_id"), f"messages[{i}].tool_use_id"),
            "content": _text(b.get("content"))}
           for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
    rest = [b for b in content if not (isinstance(b, dict) and b.get("type") == "tool_result")]
    said = _text(rest)
    if said or not out:
        out.append({"role": "user", "content": said})
    return out


def _assistant(content: Any, i: int) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    calls = [{"id": text(b.get("id"), f"messages[{i}].id"), "type": "function",
              "function": {"name": text(b.get("name"), f"messages[{i}].name"),
                           "arguments": json.dumps(b.get("input") or {})}}
             for b in content or [] if isinstance(b, dict) and b.get("type") == "tool_use"]
    message: dict[str, Any] = {"role": "assistant", "content": _text(content)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    require(isinstance(tools, list), "tools: a list", "tools")
    out = []
    for tool in tools:
        require(isinstance(tool, dict) and tool.get("name"), "tools: each needs a name", "tools")
        out.append({"type": "function", "function": {"name": text(tool["name"], "tools.name"),
                                                     "description": text(tool.get("description"), "tools.description"),
                                                     "parameters": tool.get("input_schema") or {"type": "object"}}})
    return out


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


class AnthropicMessages:
    name = "anthropic_messages"
    routes = (("POST", "/v1/messages"), ("POST", "/messages"))
    count_routes = (("POST", "/v1/messages/count_tokens"), ("POST", "/messages/count_tokens"))

    def parse(self, body: Any) -> GatewayRequest:
        require(isinstance(body, dict), "the body must be a JSON object")
        messages = body.get("messages")
        require(isinstance(messages, list) and messages, "messages: a non-empty list is required", "messages")
        out = _system(body.get("system"))
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            require(role in ("user", "assistant", "system"), f"messages[{i}].role: user, assistant or system",
                    f"messages[{i}]")
            if role == "system":  # Claude Code puts context between turns as system messages
                out.append({"role": "system", "content": _text(message.get("content"))})
            else:
                out += _user(message.get("content"), i) if role == "user" else [_assistant(message.get("content"), i)]
        try:
            sampling = SamplingParams.model_validate(sampling_fields(body, SAMPLING))
        except ValidationError as exc:
            err = exc.errors()[0]
            raise bad_request(f"{'.'.join(map(str, err['loc']))}: {err['msg']}", str(err["loc"][0])) from None
        return GatewayRequest(messages=out, tools=_tools(body.get("tools")), sampling=sampling,
                              model=body.get("model"), stream=bool(body.get("stream")))

    @staticmethod
    def _blocks(turn: Turn) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = [{"type": "text", "text": turn.content}] if (turn.content or "").strip() else []
        blocks += [{"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.name,
                    "input": _input(call.arguments)} for call in turn.tool_calls]
        return blocks

    @staticmethod
    def _stop(turn: Turn) -> str:
        if turn.tool_calls:
            return "tool_use"
        return "max_tokens" if turn.finish_reason == "length" else "end_turn"

    def _message(self, turn: Turn, request: GatewayRequest, content: list[dict[str, Any]], stop: str | None,
                 output_tokens: int) -> dict[str, Any]:
        return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": request.model or turn.model,
                "content": content, "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": len(turn.prompt_ids or []), "output_tokens": output_tokens}}

    def respond(self, turn: Turn, request: GatewayRequest) -> dict[str, Any]:
        return self._message(turn, request, self._blocks(turn), self._stop(turn), len(turn.response_ids or []))

    def stream(self, turn: Turn, request: GatewayRequest) -> Iterator[bytes]:
        def event(kind: str, **data: Any) -> bytes:
            return sse(json.dumps({"type": kind, **data}), event=kind)

        yield event("message_start", message=self._message(turn, request, [], None, 1))
        for i, block in enumerate(self._blocks(turn)):
            if block["type"] == "text":
                yield event("content_block_start", index=i, content_block={"type": "text", "text": ""})
                yield event("content_block_delta", index=i, delta={"type": "text_delta", "text": block["text"]})
            else:
                yield event("content_block_start", index=i, content_block={**block, "input": {}})
                yield event("content_block_delta", index=i,
                            delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
            yield event("content_block_stop", index=i)
        yield event("message_delta", delta={"stop_reason": self._stop(turn), "stop_sequence": None},
                    usage={"output_tokens": len(turn.response_ids or [])})
        yield event("message_stop")

    def count(self, tokens: int) -> dict[str, Any]:
        return {"input_tokens": tokens}

    def error(self, failure: Failure) -> tuple[int, dict[str, Any]]:
        message = failure.message
        if failure.kind == "context_length":
            message = f"prompt is too long: {message}"
        return failure.status, {"type": "error", "error": {"type": ERROR_TYPES.get(failure.kind, "api_error"),
                                                           "message": message}}
