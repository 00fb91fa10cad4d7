"""Which earlier call a new call continues.

A harness resends its whole history on every call. Where that history repeats an earlier call's
conversation and then that call's own answer, the new prompt is built by appending to the ids the
session already holds (the earlier prompt and the ids the model generated), never by
re-tokenising the model's output. Messages are compared in a canonical form that survives what
clients do on the way back: content as a string or a list of parts, tool-call arguments
re-serialised, null fields added or dropped."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from prorl_celery.llm.chatml import text_of
from prorl_celery.llm.models import Turn


def _args(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
    return raw or {}


@functools.lru_cache(maxsize=4096)
def _normal_args(raw: str) -> str:
    """Arguments as a string, re-serialised canonically (a harness resends the same strings on
    every call: each is parsed once)."""
    return json.dumps(_args(raw), sort_keys=True)


def _calls(message: dict[str, Any]) -> tuple:
    out = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        raw = fn.get("arguments")
        args = _normal_args(raw) if isinstance(raw, str) else json.dumps(_args(raw), sort_keys=True)
        out.append((fn.get("name"), args))
    return tuple(out)


def canonical(message: dict[str, Any]) -> tuple:
    """What of a message decides its rendering: role, text, tool calls (name, parsed arguments)."""
    content = message.get("content")
    text = content.strip() if isinstance(content, str) else text_of(content).strip()
    return (message.get("role"), text, _calls(message) if message.get("tool_calls") else ())


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


@dataclass
class Seen:
    """An earlier call as the session keeps it: what was sent and the turn it produced."""

    index: int
    messages: list[tuple]
    tools: str
    turn: Turn


def continues(seen: Seen, messages: list[tuple], tools: str) -> bool:
    """Whether ``messages`` are ``seen``'s conversation, then its answer, then anything."""
    n = len(seen.messages)
    if tools != seen.tools or len(messages) <= n or messages[:n] != seen.messages:
        return False
    answer = messages[n]
    own = canonical(seen.turn.message)
    # the answer as the model wrote it; a client may drop the text beside tool calls
    return answer[0] == "assistant" and answer[2] == own[2] and (answer[1] == own[1] or not answer[1])


def find_base(history: list[Seen], messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None) -> tuple[Seen | None, list[tuple], str]:
    """The latest earlier call that ``messages`` continue (the longest such history) or None,
    and the canonical messages and tools key (kept for the next call's search)."""
    canon = [canonical(m) for m in messages]
    key = tools_key(tools)
    best = None
    for seen in reversed(history):  # the latest first: a later one of the same length wins
        if (best is None or len(seen.messages) > len(best.messages)) and continues(seen, canon, key):
            best = seen
    if best is not None:  # the repeated history shares the earlier call's entries: memory grows with
        canon[:len(best.messages)] = best.messages  # the conversation, not with calls x conversation
    return best, canon, key

