"""What the fake server answers (test and demo tool): ``echo``, ``scripted:FILE`` and ``oracle``.

A policy sees the conversation (parsed back from the prompt ids in token mode) and returns a
:class:`Reply`. Oracles are the hook for the project's own demo and fixture tasks: a domain
handler registers ``fn(messages, tools) -> Reply | None`` under a name (or is named by dotted
path), and ``oracle`` asks each registered one in turn, falling back to echo.
"""
from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field

from prorl_celery.errors import UnknownPlugin
from prorl_celery.llm.chatml import text_of


class ReplyCall(BaseModel):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class Reply(BaseModel):
    content: str = ""
    tool_calls: list[ReplyCall] = Field(default_factory=list)


class Policy(Protocol):
    def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Reply: ...


class EchoPolicy:
    """Answers ``echo: <last message's text>``."""

    def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Reply:
        last = text_of(messages[-1].get("content")) if messages else ""
        return Reply(content=f"echo: {last}")


class ScriptedPolicy:
    """Turn *k* (k = assistant messages so far) answers entry *k* of a JSON list; past the end,
    the last entry again. An entry is a string or ``{"content", "tool_calls": [{"name",
    "arguments"}]}``; the file may also be ``{"turns": [...]}``."""

    def __init__(self, path: str | Path):
        data = json.loads(Path(path).read_text())
        turns = data["turns"] if isinstance(data, dict) else data
        self.turns = [Reply(content=t) if isinstance(t, str) else Reply.model_validate(t) for t in turns]
        if not self.turns:
            raise ValueError(f"{path}: the script has no turns")

    def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Reply:
        k = sum(1 for m in messages if m.get("role") == "assistant")
        return self.turns[min(k, len(self.turns) - 1)]


Oracle = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], Reply | None]
ORACLES: dict[str, Oracle | str] = {}
"""Oracle name -> function, or dotted path ``package.module:function`` imported on first use."""


def register_oracle(name: str, oracle: Oracle | str) -> None:
    ORACLES[name] = oracle


def _resolve(ref: Oracle | str) -> Oracle:
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


class OraclePolicy:
    """The named oracle, or every registered oracle in turn; echo when none answers."""

    def __init__(self, name: str | None = None):
        if name and name not in ORACLES and ":" not in name:
            raise UnknownPlugin(f"unknown oracle {name!r}; known: {sorted(ORACLES) or 'none'}, "
                                "or a dotted path package.module:function")
        self.name = name
        self.fallback = EchoPolicy()

    def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Reply:
        refs = [ORACLES.get(self.name, self.name)] if self.name else list(ORACLES.values())
        for ref in refs:
            answer = _resolve(ref)(messages, tools)
            if answer is not None:
                return answer
        return self.fallback.reply(messages, tools)


def load_policy(spec: str) -> Policy:
    """``echo``, ``scripted:FILE``, ``oracle`` or ``oracle:NAME`` (name or dotted path)."""
    kind, _, arg = spec.partition(":")
    if kind == "echo":
        return EchoPolicy()
    if kind == "scripted" and arg:
        return ScriptedPolicy(arg)
    if kind == "oracle":
        return OraclePolicy(arg or None)
    raise UnknownPlugin(f"unknown policy {spec!r}; known: echo, scripted:FILE, oracle[:NAME]")
