"""Health: broker and result backend reachable, how many workers consume each queue, and which
sandbox runtimes (and isolation, and limit enforcement) each live sandbox host serves."""
from __future__ import annotations

from flask import Blueprint, current_app, jsonify

from flask_api import schemas as s
from flask_api.routes import route
from flask_api.schemas import SandboxHostHealth
from prorl_celery.celery_app import app as celery_app
from prorl_celery.workers import worker_threads

bp = Blueprint("health", __name__)


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


@route(bp, "get", "/healthz", "Broker, backend and workers per queue", {200: s.HealthResponse, 503: s.HealthResponse},
       tag="operations")
def healthz():
    store = current_app.extensions["prorl_store"]
    broker_error = _ping(store.redis.ping)
    backend_error = _ping(lambda: celery_app.backend.client.ping())
    threads: dict[str, dict[str, int]] = {}
    if broker_error is None:
        broker_error = _ping(lambda: threads.update(worker_threads()))
    workers = {queue: sorted(held) for queue, held in threads.items()}
    hosts: list[dict] = []
    if broker_error is None:
        broker_error = _ping(lambda: hosts.extend(sandbox_hosts(store.redis)))
    ok = broker_error is None and backend_error is None
    body = {"ok": ok, "broker": broker_error or "ok", "backend": backend_error or "ok",
            "workers": {queue: len(names) for queue, names in workers.items()},
            "worker_names": workers, "worker_threads": threads,
            "threads": {queue: sum(held.values()) for queue, held in threads.items()},
            "sandbox_hosts": hosts}
    return jsonify(body), 200 if ok else 503
