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

from prorl_celery.errors import (BackendUnavailable, ContextWindowExceeded, InvalidRequest, LLMCallCancelled,
                                 LLMError, LLMRequestRejected, LLMTimeout)
from prorl_celery.gateway.models import GatewayRequest
from prorl_celery.llm.models import Turn


@dataclass
class Failure:
    """A failed call in no API's shape: HTTP status, our kind, a message, the field at fault."""

    status: int
    kind: str  # invalid_request | context_length | budget | auth | not_found | cancelled | unavailable | timeout
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
    from prorl_celery.gateway.session import BudgetSpent

    if isinstance(exc, BadCall):
        return exc.failure
    if isinstance(exc, ContextWindowExceeded):
        return Failure(400, "context_length", str(exc), "messages")
    if isinstance(exc, BudgetSpent):
        return Failure(403, "budget", str(exc))
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


def sampling_fields(body: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """Our sampling set from the caller's fields (``names``: our name -> theirs); None left out."""
    out = {ours: body[theirs] for ours, theirs in names.items() if body.get(theirs) is not None}
    stop = out.get("stop")
    if isinstance(stop, str):
        out["stop"] = [stop]
    return out
