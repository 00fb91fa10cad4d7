"""What every caller-API dialect of the gateway is, and the failures they all shape.

A dialect is one module with a class that has ``name``, ``routes`` (``(method, path)`` it serves),
``parse(body) -> GatewayRequest``, ``respond(turn, request) -> dict``, ``stream(turn, request) ->
Iterator[bytes]`` (server-sent events) and ``error(failure) -> (status, body)``. The session and
the server know nothing of any dialect's shapes."""
from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from prorl_celery.errors import (BackendUnavailable, BudgetSpent, ContextWindowExceeded, InvalidRequest,
                                 LLMCallCancelled, LLMError, LLMRequestRejected, LLMTimeout, QuotaExceeded,
                                 RateLimited)
from prorl_celery.gateway.models import GatewayRequest
from prorl_celery.llm.models import Turn


@dataclass
class Failure:
    """A failed call in no API's shape: HTTP status, our kind, a message, the field at fault."""

    status: int
    kind: str  # invalid_request | context_length | budget | rate_limited | too_large | auth | not_found
    # | cancelled | unavailable | timeout | internal
    message: str
    param: str | None = None


class BadCall(Exception):
    """A call the gateway refuses before generating (malformed body, unknown route, auth)."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.failure = failure


def bad_request(message: str, param: str | None = None) -> BadCall:
    return BadCall(Failure(400, "invalid_request", message, param))


class ApiDialect(Protocol):
    name: ClassVar[str]
    routes: ClassVar[tuple[tuple[str, str], ...]]

    def parse(self, body: Any) -> GatewayRequest: ...

    def respond(self, turn: Turn, request: GatewayRequest) -> dict[str, Any]: ...

    def stream(self, turn: Turn, request: GatewayRequest) -> Iterator[bytes]: ...

    def error(self, failure: Failure) -> tuple[int, dict[str, Any]]: ...


def failure_of(exc: BaseException) -> Failure:
    """The neutral failure of an exception raised while serving a call."""
    if isinstance(exc, BadCall):
        return exc.failure
    if isinstance(exc, ContextWindowExceeded):
        return Failure(400, "context_length", str(exc), "messages")
    if isinstance(exc, BudgetSpent):
        return Failure(403, "budget", str(exc))
    if isinstance(exc, RateLimited):
        return Failure(429, "rate_limited", str(exc))
    if isinstance(exc, QuotaExceeded):
        return Failure(413, "too_large", str(exc), exc.field)
    if isinstance(exc, LLMCallCancelled):
        return Failure(503, "cancelled", str(exc))
    if isinstance(exc, LLMTimeout):
        return Failure(504, "timeout", str(exc))
    if isinstance(exc, (InvalidRequest, LLMRequestRejected)):
        return Failure(400, "invalid_request", str(exc), getattr(exc, "field", None))
    if isinstance(exc, (BackendUnavailable, LLMError)):
        return Failure(503, "unavailable", str(exc))
    return Failure(500, "internal", f"{type(exc).__name__}: {exc}")


def sse(data: str, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


def new_id(prefix: str) -> str:
    return f"{prefix}{random.getrandbits(96):024x}"  # an id, not a secret: no urandom syscall per call


def now() -> int:
    return int(time.time())


def require(cond: bool, message: str, param: str | None = None) -> None:
    if not cond:
        raise bad_request(message, param)


def text(value: Any, field: str) -> str:
    """``value`` when it is a string ("" for None); else the call is refused."""
    if value is None:
        return ""
    require(isinstance(value, str), f"{field}: a string", field)
    return value


def _part(part: Any) -> dict[str, str] | None:
    """A content part as a template renders it: its text (an image or any other part: nothing)."""
    if isinstance(part, dict) and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    return None


def _tool_call(call: Any, field: str) -> dict[str, Any]:
    require(isinstance(call, dict), f"{field}: an object", field)
    fn = call.get("function")
    require(isinstance(fn, dict), f"{field}.function: an object", field)
    arguments = fn.get("arguments")
    require(arguments is None or isinstance(arguments, (str, dict)), f"{field}.function.arguments: a string", field)
    return {"id": text(call.get("id"), f"{field}.id"), "type": "function",
            "function": {"name": text(fn.get("name"), f"{field}.function.name"), "arguments": arguments or ""}}


_PLAIN = frozenset({"role", "content", "tool_call_id", "name", "reasoning_content"})
_CALL, _FUNCTION = frozenset({"id", "type", "function"}), frozenset({"name", "arguments"})


def _plain(message: dict[str, Any]) -> bool:
    """Whether ``message`` holds only strings a template renders, and tool calls of only those."""
    for key, value in message.items():
        if key == "tool_calls":
            if type(value) is not list or not all(map(_plain_call, value)):
                return False
        elif key not in _PLAIN or type(value) is not str:
            return False
    return True


def _plain_call(call: Any) -> bool:
    fn = call.get("function") if type(call) is dict else None
    return (type(fn) is dict and call.keys() <= _CALL and type(call.get("id", "")) is str
            and call.get("type", "function") == "function" and fn.keys() <= _FUNCTION
            and type(fn.get("name")) is str and type(fn.get("arguments")) is str)


def rendered(message: dict[str, Any], field: str) -> dict[str, Any]:
    """An OpenAI chat message reduced to what a chat template renders (role, content as text or
    text parts, tool calls, tool_call_id, name, reasoning_content): nothing else a caller puts
    on a message is kept, stored or rendered."""
    if _plain(message):
        return message  # the common case, as it came: nothing in it a template does not render
    out: dict[str, Any] = {"role": message["role"]}
    content = message.get("content")
    if isinstance(content, list):
        out["content"] = [p for p in map(_part, content) if p is not None]
    elif content is not None:
        out["content"] = text(content, f"{field}.content")
    calls = message.get("tool_calls")
    if calls:
        require(isinstance(calls, list), f"{field}.tool_calls: a list", f"{field}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{field}.tool_calls[{j}]") for j, c in enumerate(calls)]
    for key in ("tool_call_id", "name", "reasoning_content"):
        if message.get(key) is not None:
            out[key] = text(message[key], f"{field}.{key}")
    return out


def function_tool(fn: dict[str, Any], field: str) -> dict[str, Any]:
    """An OpenAI function tool reduced to what a template renders: its name, and its description
    and parameters (a JSON schema) where it has them."""
    out: dict[str, Any] = {"name": text(fn.get("name"), f"{field}.name")}
    if fn.get("description") is not None:
        out["description"] = text(fn["description"], f"{field}.description")
    if fn.get("parameters") is not None:
        require(isinstance(fn["parameters"], dict), f"{field}.parameters: a JSON schema object", field)
        out["parameters"] = fn["parameters"]
    return {"type": "function", "function": out}


def sampling_fields(body: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """Our sampling set from the caller's fields (``names``: our name -> theirs); None left out."""
    out = {ours: body[theirs] for ours, theirs in names.items() if body.get(theirs) is not None}
    stop = out.get("stop")
    if isinstance(stop, str):
        out["stop"] = [stop]
    return out
