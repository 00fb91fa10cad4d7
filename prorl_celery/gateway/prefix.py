"""Which earlier call a new call continues.

A harness resends its whole history on every call. Where that history repeats an earlier call's
conversation and then that call's own answer, the new prompt is built by appending to the ids the
session already holds (the earlier prompt and the ids the model generated), never by
re-tokenising the model's output. Messages are compared in a canonical form that survives what
clients do on the way back: content as a string or a list of parts, tool-call arguments
re-serialised or with properties written in at their schema defaults
(:mod:`prorl_celery.gateway.defaults`), null fields added or dropped."""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prorl_celery.gateway.defaults import filled, tool_defaults
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
def _normal_args(raw: str, defaults: str | None = None) -> str:
    """Arguments as a string, re-serialised canonically with the tool's ``defaults`` filled in (a
    harness resends the same strings on every call: each is parsed once)."""
    return json.dumps(filled(_args(raw), defaults), sort_keys=True)


def _calls(message: dict[str, Any], defaults: Mapping[str, str]) -> tuple:
    out = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        name, raw = fn.get("name"), fn.get("arguments")
        tree = defaults.get(name) if isinstance(name, str) else None
        args = (_normal_args(raw, tree) if isinstance(raw, str)
                else json.dumps(filled(_args(raw), tree), sort_keys=True))
        out.append((name, args))
    return tuple(out)


def canonical(message: dict[str, Any], defaults: Mapping[str, str] | None = None) -> tuple:
    """What of a message decides its rendering: role, text, tool calls (name, parsed arguments,
    with ``defaults``, tool name -> :func:`~prorl_celery.gateway.defaults.tool_defaults` tree,
    filled in: an omitted property and one written at its default are the same call)."""
    content = message.get("content")
    text = content.strip() if isinstance(content, str) else text_of(content).strip()
    return (message.get("role"), text, _calls(message, defaults or {}) if message.get("tool_calls") else ())


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


@dataclass
class Seen:
    """An earlier call as the session keeps it: what was sent and the turn it produced."""

    index: int
    messages: list[tuple]
    tools: str
    turn: Turn


def continues(seen: Seen, messages: list[tuple], tools: str,
              defaults: Mapping[str, str] | None = None) -> bool:
    """Whether ``messages`` are ``seen``'s conversation, then its answer, then anything (``defaults``:
    of ``tools``, as ``messages`` were made canonical with)."""
    n = len(seen.messages)
    if tools != seen.tools or len(messages) <= n or messages[:n] != seen.messages:
        return False
    answer = messages[n]
    own = canonical(seen.turn.message, defaults)
    # the answer as the model wrote it; a client may drop the text beside tool calls
    return answer[0] == "assistant" and answer[2] == own[2] and (answer[1] == own[1] or not answer[1])


def find_base(history: list[Seen], messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None) -> tuple[Seen | None, list[tuple], str]:
    """The latest earlier call that ``messages`` continue (the longest such history) or None,
    and the canonical messages and tools key (kept for the next call's search)."""
    key = tools_key(tools)
    defaults = tool_defaults(key) if tools else {}
    canon = [canonical(m, defaults) for m in messages]
    best = None
    for seen in reversed(history):  # the latest first: a later one of the same length wins
        if (best is None or len(seen.messages) > len(best.messages)) and continues(seen, canon, key, defaults):
            best = seen
    if best is not None:  # the repeated history shares the earlier call's entries: memory grows with
        canon[:len(best.messages)] = best.messages  # the conversation, not with calls x conversation
    return best, canon, key


def rendered_turns(messages: list[dict[str, Any]], base: Seen | None) -> int:
    """The assistant messages of ``messages`` a prompt continued from ``base`` renders from text:
    those past ``base``'s answer (up to it the ids ``base`` holds are reused), or all of them
    when nothing is continued. Once a session has generated, each is a turn of the model's
    re-tokenised: a resent answer the harness changed, or one a continuation skipped."""
    start = len(base.messages) + 1 if base is not None else 0
    return sum(1 for m in messages[start:] if m.get("role") == "assistant")
