"""Health: broker and result backend reachable, and how many workers consume each queue."""
from __future__ import annotations

from flask import Blueprint, current_app, jsonify

from config.celeryconfig import QUEUES
from prorl_celery.celery_app import app as celery_app

bp = Blueprint("health", __name__)


def workers_per_queue(timeout: float = 1.0) -> dict[str, list[str]]:
    replies = celery_app.control.inspect(timeout=timeout).active_queues() or {}
    out: dict[str, list[str]] = {name: [] for name in QUEUES}
    for worker, queues in replies.items():
        for queue in queues:
            out.setdefault(queue["name"], []).append(worker)
    return {name: sorted(workers) for name, workers in out.items()}


def _ping(check) -> str | None:
    try:
        check()
        return None
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"{type(exc).__name__}: {exc}"


@bp.get("/healthz")
def healthz():
    store = current_app.extensions["prorl_store"]
    broker_error = _ping(store.redis.ping)
    backend_error = _ping(lambda: celery_app.backend.client.ping())
    workers = workers_per_queue() if broker_error is None else {}
    ok = broker_error is None and backend_error is None
    body = {"ok": ok, "broker": broker_error or "ok", "backend": backend_error or "ok",
            "workers": {queue: len(names) for queue, names in workers.items()},
            "worker_names": workers}
    return jsonify(body), 200 if ok else 503
