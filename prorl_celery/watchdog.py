"""A worker-side watchdog for a known Celery/kombu fault: after the Redis broker restarts, a worker
can reconnect and yet never take another message from a queue (celery#8030, #8091, #10205).

Every ``consumer_watchdog_s`` each worker looks at the queues it consumes. When a queue has had
messages waiting at two checks in a row, the worker has idle threads, and it received nothing in
between, its consumer for that queue is stalled: the watchdog asks the worker (through its own
control channel, so the change runs in the consumer's thread) to cancel and re-add the consumer,
which makes it fetch again. If the worker does not answer at all, it exits with status 75 to be
restarted by its supervisor (``prorl-celery up`` and the Slurm scripts restart workers). (A queue the worker was started with is kept consumed: one cancelled
by hand comes back after two periods.)
"""
from __future__ import annotations

import logging
import os
import threading

from celery.signals import task_postrun, task_prerun, task_received, worker_ready, worker_shutting_down

from config.settings import get_settings

log = logging.getLogger(__name__)
EXIT_STALLED = 75


class _Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received = 0
        self.running = 0


counters = _Counters()
_stop = threading.Event()


@task_received.connect
def _on_received(**_) -> None:
    with counters.lock:
        counters.received += 1


@task_prerun.connect
def _on_prerun(**_) -> None:
    with counters.lock:
        counters.running += 1


@task_postrun.connect
def _on_postrun(**_) -> None:
    with counters.lock:
        counters.running -= 1


class ConsumerWatchdog(threading.Thread):
    def __init__(self, consumer, period_s: float):
        super().__init__(name="consumer-watchdog", daemon=True)
        self.consumer = consumer
        self.period_s = period_s
        self.app = consumer.app
        self.hostname = consumer.hostname
        self.concurrency = getattr(consumer.controller, "concurrency", None) or self.app.conf.worker_concurrency
        self.suspect: dict[str, int] = {}  # queue -> received count when first seen waiting
        task_consumer = getattr(consumer, "task_consumer", None)
        # the queues the worker was started with: a stalled consumer may or may not still list them
        self.watched = [q.name for q in (task_consumer.queues if task_consumer else [])]

    def queues(self) -> list[str]:
        return self.watched

    def check(self, client) -> list[str]:
        with counters.lock:
            received, idle = counters.received, counters.running < self.concurrency
        restarted = []
        for queue in self.queues():
            waiting = client.llen(queue) > 0
            if not (waiting and idle):
                self.suspect.pop(queue, None)
                continue
            if self.suspect.get(queue) == received:
                log.warning("consumer for queue %r took nothing while %d message(s) waited and threads were idle; "
                            "re-adding it", queue, client.llen(queue))
                destination = [self.hostname]
                self.app.control.cancel_consumer(queue, destination=destination, reply=True, timeout=5)
                replies = self.app.control.add_consumer(queue, destination=destination, reply=True, timeout=5)
                if not replies:
                    self.give_up(queue)
                restarted.append(queue)
                self.suspect.pop(queue, None)
            else:
                self.suspect[queue] = received
        return restarted

    def give_up(self, queue: str) -> None:
        """The consumer does not even answer its control channel (seen: its hub failed to
        restart after a broker reconnect). Exit, so the supervisor starts a fresh worker; the
        stages this process ran lose their leases and the sweep sends them again."""
        log.error("worker %s no longer consumes %r and does not answer control commands; exiting so "
                  "that it is restarted", self.hostname, queue)
        logging.shutdown()
        os._exit(EXIT_STALLED)

    def run(self) -> None:
        from prorl_celery.connections import get_redis

        while not _stop.wait(self.period_s):
            try:
                self.check(get_redis())
            except Exception as exc:  # noqa: BLE001 - the broker may be down right now; try next period
                log.info("consumer watchdog check failed: %s", exc)


@worker_ready.connect
def _start(sender=None, **_) -> None:
    period = get_settings().consumer_watchdog_s
    if sender is not None and period > 0:
        watchdog = ConsumerWatchdog(sender, period)
        watchdog.start()
        log.info("consumer watchdog watching %s every %gs", watchdog.watched, period)


@worker_shutting_down.connect
def _shutdown(**_) -> None:
    _stop.set()
