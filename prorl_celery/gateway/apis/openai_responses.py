"""OpenAI Responses: ``POST /v1/responses`` (plain and ``stream``), stateless (``store`` and
``previous_response_id`` are not kept: the caller sends its whole input, as Codex does).

Input items map to chat messages: ``message`` items by role (``developer`` as ``system``,
``input_text``/``output_text`` parts as text), ``function_call`` items onto the assistant
message before them (one assistant message per turn, as the model wrote it), each
``function_call_output`` to a ``tool`` message; ``reasoning`` items are dropped. Only ``function``
tools are rendered (a template has no place for the others), those of a ``namespace`` tool (Codex
groups an MCP server's tools in one, ``mcp__<server>``) as ``<namespace>__<name>``: a call of one
goes back as a ``function_call`` with its ``namespace``, and comes in again under the same name."""
from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from prorl_celery.gateway.apis.base import Failure, bad_request, new_id, now, require, sampling_fields, sse, text
from prorl_celery.gateway.apis.openai_chat import ERROR_TYPES
from prorl_celery.gateway.models import GatewayRequest
from prorl_celery.llm.chatml import text_of
from prorl_celery.llm.models import SamplingParams, Turn

SAMPLING = {"temperature": "temperature", "top_p": "top_p", "max_tokens": "max_output_tokens",
            "tool_choice": "tool_choice"}


def _content(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return text_of(content)


def _messages(items: Any, instructions: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": text(instructions, "instructions")})
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    require(isinstance(items, list) and items, "input: a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        require(isinstance(item, dict), f"input[{i}]: an object", f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            require(role in ("system", "user", "assistant"), f"input[{i}].role", f"input[{i}]")
            out.append({"role": role, "content": _content(item.get("content"))})
        elif kind == "function_call":
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(
                {"id": text(item.get("call_id"), f"input[{i}].call_id"), "type": "function",
                 "function": {"name": _joined(item.get("namespace"), text(item.get("name"), f"input[{i}].name")),
                              "arguments": text(item.get("arguments"), f"input[{i}].arguments")}})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": text(item.get("call_id"), f"input[{i}].call_id"),
                        "content": output if isinstance(output, str) else _content(output)})
    return out


def _joined(namespace: Any, name: str) -> str:
    return f"{namespace}__{name}" if isinstance(namespace, str) and namespace else name


def _functions(tools: Any) -> list[tuple[str | None, dict[str, Any]]]:
    """(namespace, tool) of each function tool, those inside ``namespace`` tools included."""
    out: list[tuple[str | None, dict[str, Any]]] = []
    for t in tools or []:
        if isinstance(t, dict) and t.get("type") == "function":
            out.append((None, t))
        elif isinstance(t, dict) and t.get("type") == "namespace" and isinstance(t.get("tools"), list):
            ns = text(t.get("name"), "tools.name")
            out += [(ns, inner) for inner in t["tools"] if isinstance(inner, dict) and inner.get("type") == "function"]
    return out


def _tools(tools: Any) -> tuple[list[dict[str, Any]] | None, dict[str, tuple[str, str]]]:
    rendered, namespaced = [], {}
    for ns, t in _functions(tools):
        name = text(t.get("name"), "tools.name")
        if ns:
            namespaced[_joined(ns, name)] = (ns, name)
        rendered.append({"type": "function", "function": {
            "name": _joined(ns, name), "description": text(t.get("description"), "tools.description"),
            "parameters": t.get("parameters") or {"type": "object"}}})
    return rendered or None, namespaced


class OpenAIResponses:
    name = "openai_responses"
    routes = (("POST", "/v1/responses"), ("POST", "/responses"))

    def parse(self, body: Any) -> GatewayRequest:
        require(isinstance(body, dict), "the body must be a JSON object")
        require(not body.get("previous_response_id"), "previous_response_id: this gateway keeps no responses; "
                "send the whole input", "previous_response_id")
        messages = _messages(body.get("input"), body.get("instructions"))
        try:
            sampling = SamplingParams.model_validate(sampling_fields(body, SAMPLING))
        except ValidationError as exc:
            err = exc.errors()[0]
            raise bad_request(f"{'.'.join(map(str, err['loc']))}: {err['msg']}", str(err["loc"][0])) from None
        tools, namespaced = _tools(body.get("tools"))
        return GatewayRequest(messages=messages, tools=tools, namespaced=namespaced, sampling=sampling,
                              model=body.get("model"), stream=bool(body.get("stream")))

    @staticmethod
    def _items(turn: Turn, request: GatewayRequest) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if (turn.content or "").strip():
            items.append({"type": "message", "id": new_id("msg_"), "status": "completed", "role": "assistant",
                          "content": [{"type": "output_text", "text": turn.content, "annotations": []}]})
        for call in turn.tool_calls:
            ns, name = request.namespaced.get(call.name, (None, call.name))
            items.append({"type": "function_call", "id": new_id("fc_"), "call_id": call.id, "name": name,
                          **({"namespace": ns} if ns else {}), "arguments": call.arguments, "status": "completed"})
        return items

    def _response(self, turn: Turn, request: GatewayRequest, output: list[dict[str, Any]], status: str,
                  rid: str) -> dict[str, Any]:
        cut = turn.finish_reason == "length" and not turn.tool_calls
        p, c = len(turn.prompt_ids or []), len(turn.response_ids or [])
        return {"id": rid, "object": "response", "created_at": now(), "model": request.model or turn.model,
                "status": "incomplete" if status == "completed" and cut else status, "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "usage": {"input_tokens": p, "output_tokens": c, "total_tokens": p + c,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}}

    def respond(self, turn: Turn, request: GatewayRequest) -> dict[str, Any]:
        return self._response(turn, request, self._items(turn, request), "completed", new_id("resp_"))

    def stream(self, turn: Turn, request: GatewayRequest) -> Iterator[bytes]:
        seq, rid, items = itertools.count(), new_id("resp_"), self._items(turn, request)

        def event(kind: str, **data: Any) -> bytes:
            return sse(json.dumps({"type": kind, "sequence_number": next(seq), **data}), event=kind)

        yield event("response.created", response=self._response(turn, request, [], "in_progress", rid))
        yield event("response.in_progress", response=self._response(turn, request, [], "in_progress", rid))
        for i, item in enumerate(items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                yield event("response.output_item.added", output_index=i, item={**item, "status": "in_progress",
                                                                                 "content": []})
                part = {"type": "output_text", "text": "", "annotations": []}
                yield event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0, part=part)
                yield event("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0, delta=text)
                yield event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=text)
                yield event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                            part={**part, "text": text})
            else:
                yield event("response.output_item.added", output_index=i,
                            item={**item, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                            arguments=item["arguments"])
            yield event("response.output_item.done", output_index=i, item=item)
        yield event("response.completed", response=self._response(turn, request, items, "completed", rid))

    def error(self, failure: Failure) -> tuple[int, dict[str, Any]]:
        code = "context_length_exceeded" if failure.kind == "context_length" else failure.kind
        return failure.status, {"error": {"message": failure.message, "type": ERROR_TYPES.get(failure.kind, "error"),
                                          "param": failure.param, "code": code}}
