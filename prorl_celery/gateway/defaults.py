"""Tool-call arguments with the tool's JSON-schema defaults filled in.

A harness may resend a tool call with properties the model left out written in at their schema
default (Claude Code resends ``Edit`` with ``"replace_all": false``). Both forms mean the same
call, so the gateway compares arguments with every omitted property that has a ``default`` filled
in, on both sides, into nested objects (``properties``) and arrays of them (``items``).

A tool's defaults are kept as a small "tree" (only the parts of its schema that carry defaults),
serialised to a string so it can key a cache: ``{"d": {name: default}, "p": {name: subtree},
"i": subtree-of-items}``. Schemas come from the harness: the walk stops at ``MAX_DEPTH``."""
from __future__ import annotations

import functools
import hashlib
import json
import threading
from typing import Any

MAX_DEPTH = 32
CACHED_SETS = 32  # tool sets whose defaults are kept (keyed by a digest: a tool set may be MiBs)
CACHED_MAX_BYTES = 1 << 16  # of one set's trees; a larger one is read again on each call
_cache: dict[bytes, dict[str, str]] = {}
_cache_lock = threading.Lock()


def _tree(schema: Any, depth: int = 0) -> dict[str, Any] | None:
    """The defaults under ``schema`` (None: it has none)."""
    if not isinstance(schema, dict) or depth >= MAX_DEPTH:
        return None
    out: dict[str, Any] = {}
    props = schema.get("properties")
    if isinstance(props, dict):
        found = {k: v["default"] for k, v in props.items() if isinstance(v, dict) and "default" in v}
        nested = {k: sub for k, v in props.items() if (sub := _tree(v, depth + 1))}
        if found:
            out["d"] = found
        if nested:
            out["p"] = nested
    items = _tree(schema.get("items"), depth + 1)
    if items:
        out["i"] = items
    return out or None


def tool_defaults(tools_key: str) -> dict[str, str]:
    """Tool name -> its defaults tree as a string, for the tools serialised as ``tools_key``
    (:func:`prorl_celery.gateway.prefix.tools_key`); tools without defaults are left out. A
    session sends the same tools on every call: each set is read once."""
    digest = hashlib.blake2b(tools_key.encode(), digest_size=16).digest()
    found = _cache.get(digest)
    if found is None:
        found = _read(tools_key)
        if sum(map(len, found.values())) <= CACHED_MAX_BYTES:
            with _cache_lock:
                if len(_cache) >= CACHED_SETS:
                    _cache.pop(next(iter(_cache)))
                _cache[digest] = found
    return found


def _read(tools_key: str) -> dict[str, str]:
    try:
        tools = json.loads(tools_key)
    except ValueError:
        return {}
    out: dict[str, str] = {}
    for tool in tools if isinstance(tools, list) else ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        tree = _tree(fn.get("parameters"))
        if tree:
            out[fn["name"]] = json.dumps(tree, sort_keys=True)
    return out


@functools.lru_cache(maxsize=256)
def _parsed(tree: str) -> dict[str, Any]:
    return json.loads(tree)


def filled(value: Any, tree: str | None) -> Any:
    """``value`` (parsed arguments) with the omitted properties of ``tree`` at their defaults
    (a copy; ``value`` is not changed)."""
    return _filled(value, _parsed(tree)) if tree else value


def _filled(value: Any, tree: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        out = dict(value)
        for name, default in tree.get("d", {}).items():
            out.setdefault(name, default)
        for name, sub in tree.get("p", {}).items():
            if name in out:
                out[name] = _filled(out[name], sub)
        return out
    if isinstance(value, list) and "i" in tree:
        return [_filled(item, tree["i"]) for item in value]
    return value
