"""Two small things every module that talks to Redis needs: the text of a reply, and a Lua script
sent by its digest.

:class:`LuaScript` sends ``EVALSHA``, one round trip; redis-py's registered script on a pipeline
first asks ``SCRIPT EXISTS`` of Redis, one more. A Redis that does not have the script (never ran
it, restarted, flushed its cache) answers ``NoScriptError``, and then the script goes whole once
(``EVAL`` also puts it in Redis's cache for the next digest).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis


def text(value: bytes | str) -> str:
    """A reply's text (a client made with ``decode_responses`` already gives str)."""
    return value.decode() if isinstance(value, bytes) else value


def missing(reply: Any) -> bool:
    """Whether a pipeline's reply (sent with ``raise_on_error=False``) says Redis lacked the script."""
    return isinstance(reply, redis.exceptions.NoScriptError)


class LuaScript:
    """A Lua script's text and digest; called, queued by digest, or queued whole."""

    def __init__(self, source: str):
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, client: redis.Redis, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        """Run it: by digest, then whole if Redis lacked it."""
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return self.whole(client, keys, args)

    def whole(self, client: Any, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        """Run it (or, on a pipeline, queue it) as text: what follows a :func:`missing` reply."""
        return client.eval(self.source, len(keys), *keys, *args)

    def queue(self, pipe: Any, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> None:
        """Queue it on ``pipe`` by digest; the caller looks at the reply with :func:`missing`."""
        pipe.evalsha(self.sha, len(keys), *keys, *args)
