"""Celery settings, derived from :mod:`config.settings`. Every choice here is deliberate:

- Stages wait on sandboxes and inference servers, not on the CPU, so stage workers use the thread
  pool with many threads (``worker_concurrency``); budgets and cancellation are enforced by the
  service itself (the thread pool has no time limits and no ``terminate``).
- ``acks_late`` + prefetch 1: a message is acknowledged only after its stage finished, so a
  killed worker's stage is delivered again; a stage lease in Redis keeps a duplicate from running
  while the first holder lives, and the beat sweep re-dispatches a stage whose lease lapsed.
- The broker's visibility timeout is well above the largest stage budget, so a long stage is never
  redelivered while it still runs.
"""
from __future__ import annotations

from kombu import Exchange, Queue

from config.settings import get_settings

_s = get_settings()
QUEUES = ("init", "run", "eval", "maint")

broker_url = _s.redis_url
result_backend = _s.backend_url
broker_connection_retry_on_startup = True
broker_transport_options = {
    "visibility_timeout": int(max(2 * _s.largest_budget_s + 600, 3600)),
    "socket_keepalive": True,
    "health_check_interval": 25,
}
result_backend_transport_options = {"retry_policy": {"timeout": 5.0}}

task_queues = tuple(Queue(name, Exchange(name, type="direct"), routing_key=name) for name in QUEUES)
task_default_queue = "maint"
task_create_missing_queues = False
task_routes = {
    "prorl.init": {"queue": "init", "routing_key": "init"},
    "prorl.run": {"queue": "run", "routing_key": "run"},
    "prorl.eval": {"queue": "eval", "routing_key": "eval"},
    "prorl.*": {"queue": "maint", "routing_key": "maint"},
}

task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
task_acks_late = True
task_reject_on_worker_lost = True
task_track_started = False  # nothing reads STARTED (Flower has the events): a backend write per stage saved
result_extended = True
# One result backend (one connection pool) for all of a worker's threads, not one each: a run
# worker of a thousand threads otherwise built a backend per thread at its first result (a
# thousand pools, a connection each, all at once when a bulk cancel ended every stage).
result_backend_thread_safe = True
redis_max_connections = 4096  # that shared pool's cap (made as needed): redis-py would fail past 100
result_expires = _s.result_expires_s
worker_deduplicate_successful_tasks = True
worker_prefetch_multiplier = 1
worker_pool = "threads"
worker_concurrency = _s.worker_concurrency
worker_cancel_long_running_tasks_on_connection_loss = True
worker_send_task_events = True
task_send_sent_event = True
worker_hijack_root_logger = False

beat_schedule = {
    "sweep": {
        "task": "prorl.sweep",
        "schedule": _s.sweep_interval_s,
        "options": {"expires": _s.sweep_interval_s, "queue": "maint"},
    },
}
