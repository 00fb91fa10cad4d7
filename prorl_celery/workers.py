"""Which workers consume which queue, with how many threads (Celery's inspect replies)."""
from __future__ import annotations

from config.celeryconfig import QUEUES
from prorl_celery.celery_app import app as celery_app


def workers_per_queue(timeout: float = 1.0) -> dict[str, list[str]]:
    replies = celery_app.control.inspect(timeout=timeout).active_queues() or {}
    out: dict[str, list[str]] = {name: [] for name in QUEUES}
    for worker, queues in replies.items():
        for queue in queues:
            out.setdefault(queue["name"], []).append(worker)
    return {name: sorted(workers) for name, workers in out.items()}


def worker_threads(timeout: float = 1.0, workers: list[str] | None = None) -> dict[str, dict[str, int]]:
    """Queue -> worker -> threads its pool holds (Celery's ``stats``: ``pool.max-concurrency``),
    asked in parallel with the queues each consumes, so both cost one timeout. Celery waits the
    whole timeout for replies, unless only the named ``workers`` are asked: then it returns once
    they all replied."""
    from concurrent.futures import ThreadPoolExecutor

    inspect = celery_app.control.inspect(timeout=timeout, destination=workers or None,
                                         limit=len(workers) if workers else None)
    with ThreadPoolExecutor(2) as pool:
        queues_f, stats_f = pool.submit(inspect.active_queues), pool.submit(inspect.stats)
        queues, stats = queues_f.result() or {}, stats_f.result() or {}
    out: dict[str, dict[str, int]] = {name: {} for name in QUEUES}
    for worker, consumed in queues.items():
        threads = int(((stats.get(worker) or {}).get("pool") or {}).get("max-concurrency") or 0)
        for queue in consumed:
            out.setdefault(queue["name"], {})[worker] = threads
    return out
