"""JSON on the wire, where bodies are large: a turn's prompt is up to tens of thousands of token
ids, sent on every turn. orjson encodes and parses such a list ~10x faster than the standard
library; what it refuses (integers past 64 bits, NaN and Infinity literals some servers write,
keys that are not strings) falls back to :mod:`json`, so the two accept the same documents."""
from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # a stripped-down install: the standard library alone
    orjson = None


def dumps(obj: Any) -> bytes:
    """``obj`` as UTF-8 JSON bytes."""
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except TypeError:
            pass
    return json.dumps(obj).encode()


def loads(data: bytes | str) -> Any:
    """The document in ``data``; a ValueError when it is not JSON."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)
