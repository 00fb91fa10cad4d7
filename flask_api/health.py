"""Health: broker and result backend reachable, how many workers consume each queue, and which
sandbox runtimes (and isolation, and limit enforcement) each live sandbox host serves."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from flask import Blueprint, current_app, jsonify

from flask_api import schemas as s
from flask_api.routes import route
from flask_api.schemas import SandboxHostHealth
from prorl_celery.celery_app import app as celery_app
from prorl_celery.llm.store import routing_redis
from prorl_celery.workers import worker_threads

bp = Blueprint("health", __name__)
log = logging.getLogger(__name__)
Census = dict[str, dict[str, int]]


class WorkerCensus:
    """The workers per queue for ``/healthz``, without waiting a second each time.

    Celery's inspect collects replies for its whole timeout (1 s), so every probe took over a
    second. Here a full census (the whole timeout: it finds new workers) names the workers; a
    probe asks only those, and returns as soon as they all replied (one gone waits the timeout
    and shows it). The full census runs again in the background once the last is
    ``full_every_s`` old, so a new worker shows within about that; in the probe itself only
    when none was ever taken. With no worker named, the last census is the answer."""

    def __init__(self, fetch: Callable[[list[str] | None], Census] = lambda workers: worker_threads(workers=workers),
                 full_every_s: float = 2.0):
        self.fetch, self.full_every_s = fetch, full_every_s
        self._full: Census | None = None
        self._taken = 0.0
        self._running = False
        self._lock = threading.Lock()

    def get(self) -> Census:
        with self._lock:
            full, stale = self._full, time.monotonic() - self._taken > self.full_every_s
            if full is not None and stale and not self._running:
                self._running = True
                threading.Thread(target=self._background, daemon=True, name="worker-census").start()
        if full is None:
            return self._census()
        named = sorted({worker for held in full.values() for worker in held})
        return self.fetch(named) if named else full

    def _census(self) -> Census:
        try:
            full = self.fetch(None)
        finally:
            with self._lock:
                self._running = False
        with self._lock:
            self._full, self._taken = full, time.monotonic()
        return full

    def _background(self) -> None:
        try:
            self._census()
        except Exception:  # noqa: BLE001 - the next probe tries again; the broker ping reports an outage
            log.warning("worker census failed", exc_info=True)


def _ping(check, attempts: int = 2) -> str | None:
    """None if ``check`` succeeds; else its error. A second try lets a client whose connection
    went stale (Redis restarted) reconnect."""
    error = None
    for _ in range(attempts):
        try:
            check()
            return None
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            error = f"{type(exc).__name__}: {exc}"
    return error


def sandbox_hosts(client) -> list[dict]:
    """Each live sandbox host's runtimes, what ``auto`` means there, their isolation and how the
    node enforces each limit (never its token)."""
    from sandboxes.client import live_hosts

    return [SandboxHostHealth.model_validate(record.model_dump()).model_dump()
            for record in live_hosts(client)]


def init_app(app) -> None:
    app.extensions["prorl_census"] = WorkerCensus()


@route(bp, "get", "/healthz", "Broker, backend and workers per queue", {200: s.HealthResponse, 503: s.HealthResponse},
       tag="operations")
def healthz():
    store = current_app.extensions["prorl_store"]
    broker_error = _ping(store.redis.ping)
    backend_error = _ping(lambda: celery_app.backend.client.ping())
    threads: dict[str, dict[str, int]] = {}
    if broker_error is None:
        broker_error = _ping(lambda: threads.update(current_app.extensions["prorl_census"].get()))
    workers = {queue: sorted(held) for queue, held in threads.items()}
    hosts: list[dict] = []
    if broker_error is None:
        broker_error = _ping(lambda: hosts.extend(sandbox_hosts(store.redis)))
    shards = [_ping(client.ping) or "ok" for client in store.shards.stores]
    routing = routing_redis(store.redis)
    routed = None if routing is store.redis else _ping(routing.ping) or "ok"
    ok = (broker_error is None and backend_error is None and all(state == "ok" for state in shards)
          and routed in (None, "ok"))
    body = {"store_shards": shards, "routing": routed, "ok": ok, "broker": broker_error or "ok", "backend": backend_error or "ok",
            "workers": {queue: len(names) for queue, names in workers.items()},
            "worker_names": workers, "worker_threads": threads,
            "threads": {queue: sum(held.values()) for queue, held in threads.items()},
            "sandbox_hosts": hosts}
    return jsonify(body), 200 if ok else 503
