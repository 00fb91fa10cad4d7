"""Caps on long-lived requests: server-sent event streams, long polls, ``/process``.

Each such request holds a server thread (and, while it blocks on Redis, a connection) for as long
as it lasts. Without a cap, a few hundred idle ``GET /events`` take every thread and ``/healthz``
and submissions time out. So they are counted per client (remote address) and in total, and one
over either cap is refused at once with 429. The server gives them threads of their own on top of
the ordinary ones (see ``prorl_celery.ops.cli._serve_options``), so ordinary requests always find one.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from flask import current_app, request

from prorl_celery.errors import TooManyStreams


class StreamLimiter:
    """Counts held slots per client and in total; thread-safe."""

    def __init__(self, total: int, per_client: int):
        self.total, self.per_client = total, per_client
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def acquire(self, client: str) -> Callable[[], None]:
        """Take a slot for ``client``; returns its release (idempotent). Raises TooManyStreams."""
        with self._lock:
            mine, everyone = self._held.get(client, 0), sum(self._held.values())
            if mine >= self.per_client:
                raise TooManyStreams(f"this client already holds {mine} streams or long polls "
                                     f"(limit {self.per_client}); close one or poll without waiting")
            if everyone >= self.total:
                raise TooManyStreams(f"the API already serves {everyone} streams or long polls "
                                     f"(limit {self.total}); retry later")
            self._held[client] = mine + 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
                left = self._held.get(client, 1) - 1
                if left > 0:
                    self._held[client] = left
                else:
                    self._held.pop(client, None)
        return release


def client_key() -> str:
    return request.remote_addr or "?"


def acquire_stream() -> Callable[[], None]:
    """A slot of the app's limiter for the current request's client (TooManyStreams if none)."""
    limiter: StreamLimiter = current_app.extensions["prorl_streams"]
    return limiter.acquire(client_key())


def init_app(app) -> None:
    from config.settings import get_settings

    settings = get_settings()
    app.extensions["prorl_streams"] = StreamLimiter(
        app.config.get("MAX_STREAMS", settings.api_max_streams),
        app.config.get("MAX_STREAMS_PER_CLIENT", settings.api_max_streams_per_client))
