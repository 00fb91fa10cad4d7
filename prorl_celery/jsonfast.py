"""JSON on the per-call paths (the session gateway's bodies, the LLM transport's requests and
answers) through orjson: a token-mode request is mostly a list of thousands of ids, which the
standard library encodes and parses several times slower. Whatever orjson refuses (NaN and
Infinity in a body, integers past 64 bits, keys that are not strings) goes through the standard
library as before, so what is accepted and its errors do not change."""
from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    """Compact JSON as UTF-8 bytes."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":")).encode()


def loads(data: bytes | str) -> Any:
    """The document in ``data``; ValueError (json.JSONDecodeError) when it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
