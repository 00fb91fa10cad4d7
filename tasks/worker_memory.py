"""The run worker's memory under a limit of its own (issue 32: the harness is the attacker).

A harness session's gateway lives in the run worker process: what a harness makes it allocate is
that process's memory. Each run worker process enters a memory cgroup of its own at start
(``run_worker_memory_mb``; :mod:`sandboxes.runtimes.limits.owncg`), nested in the cgroup it was
started in, so a worker that grows past the operator's limit is killed by the kernel (SIGKILL)
and nothing else on the node starves; its stages come back through the lost-worker path
(``acks_late``, the stage lease, the beat's sweep) as for any killed worker. The group is removed
when the worker exits; one a killed worker left goes at the next worker's start (or the
launcher's stop). Where the node has no cgroup this process may use, the worker says so in its
log and runs without the limit (no ``RLIMIT_AS`` instead: a thousand thread stacks and malloc
arenas reserve far more address space than they use, so an address-space cap that fits would
kill an honest worker).
"""
from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path

from celery.signals import worker_init, worker_ready, worker_shutdown

from config.settings import get_settings
from sandboxes.runtimes.limits import owncg

log = logging.getLogger(__name__)

PREFIX = "prorl-run-worker"
FLOOR_MB = 1024
_group: Path | None = None


def default_limit_mb(processes: int) -> int:
    """Half of what the node (or the cgroup the worker starts in) has, split between the run
    worker's processes, and never under ``FLOOR_MB``."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    parent = owncg.current_memory_cgroup()
    try:
        total = min(total, int((parent / "memory.limit_in_bytes").read_text())) if parent else total
    except (OSError, ValueError):
        pass
    return max(FLOOR_MB, (total >> 20) // 2 // max(1, processes))


def limit_mb() -> int:
    """The limit of one run worker process, MiB (0: none)."""
    settings = get_settings()
    if settings.run_worker_memory_mb is not None:
        return settings.run_worker_memory_mb
    return default_limit_mb(settings.run_worker_processes)


def serves_run(worker) -> bool:
    queues = getattr(getattr(getattr(worker, "app", None), "amqp", None), "queues", None)
    return bool(queues) and "run" in (queues.consume_from or {})


@worker_init.connect
def _enter(sender=None, **_: object) -> None:
    global _group
    mb = limit_mb()
    if not mb or not serves_run(sender):
        return
    why = owncg.why_not()
    if why:
        log.warning("run worker memory NOT limited (run_worker_memory_mb=%d): %s", mb, why)
        return
    try:
        _group = owncg.place(PREFIX, mb)
    except OSError as exc:
        log.warning("run worker memory NOT limited (run_worker_memory_mb=%d): %s", mb, exc)
        return
    atexit.register(_leave)


@worker_ready.connect
def _say(**_: object) -> None:  # the worker's log is set up by now (not yet at worker_init)
    if _group is not None:
        log.info("run worker memory limited to %d MiB (cgroup %s)", limit_mb(), _group)


@worker_shutdown.connect
def _leave(**_: object) -> None:
    global _group
    group, _group = _group, None
    if group is not None:
        owncg.leave(group)


def sweep_left() -> int:
    """Remove the groups of run workers started from this process that were killed (their
    group is left empty): the launcher's, when it stops."""
    return owncg.sweep(PREFIX) if not owncg.why_not() else 0
