"""CPU for killed sandboxes until they are gone, not for the ones still running.

Every sandbox cgroup sits under ``/sys/fs/cgroup/cpu/prorl``, which competes at the node's root
with each runnable thread of the service as one entity of weight 1024. A bulk cancel kills a
thousand sandboxes at once, and their processes' exits (namespaces, mounts, memory) are kernel
work done in those processes, under that one weight, while the run worker's thousand stages
wake for the same cancel: the last sandbox died seconds after its kill (bench/RESULTS.md, bulk
cancel). A standing higher weight would let busy sandboxes starve the service, so the weight is
raised only while killed sandboxes are dying:

- each sandbox a bulk close is about to kill gets the largest weight in its own cgroup, so that
  among the sandboxes the dying ones run first (:func:`hasten`, before the kill: no exit
  competes with that write yet);
- after the kills ``prorl`` weighs 1024 per dying sandbox, each counted as one thread of the
  service, at most :data:`MAX_SHARES` (:func:`commit`);
- the weight is lowered as they exit (a pidfd each turns readable) and set back to 1024 once
  the last exited, or :data:`LONGEST_S` after the last kill, whichever comes first.

Sandboxes keep their own CFS quota throughout. What a living sandbox can get from it: while
killed ones are runnable, little (they hold the largest weight among the sandboxes); between
the last exit and the watcher's next look (0.15 s, more when the host itself waits for CPU),
the raised weight, within its own quota. A host that starts resets ``prorl``'s weight
(:func:`reset`), so a host killed during a boost leaves none behind. Hosts sharing a node share
``prorl``: the first to see its own dying sandboxes gone sets it back.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from pathlib import Path

from sandboxes.runtimes.limits.cgroups import PREFIX, V1_ROOT, _write as _write_or_raise

log = logging.getLogger(__name__)

BASE_SHARES = 1024  # the kernel's default weight, one thread's
MAX_SHARES = 262144  # the largest cpu.shares cgroup v1 takes
LONGEST_S = 10.0  # a boost ends this long after the last kill even if some process never exits


def _write(path: Path, value: int) -> bool:
    try:
        _write_or_raise(path, value)
        return True
    except OSError:  # the cgroup went meanwhile (a teardown), or the node has none
        return False


def level(dying: int) -> int:
    """``prorl``'s weight while ``dying`` sandboxes are dying: one thread's each, at most MAX_SHARES."""
    return min(MAX_SHARES, BASE_SHARES * (1 + dying))


class ExitBoost:
    """The dying sandboxes of this process and the weight they hold (:func:`hasten` and
    :func:`commit` reach the one of the process)."""

    def __init__(self, parent: Path):
        self.parent = parent  # the cpu cgroup all sandboxes are under
        self._lock = threading.Lock()
        self._fds: list[int] = []
        self._shares = BASE_SHARES
        self._last_kill = 0.0
        self._watcher: threading.Thread | None = None

    @property
    def dying(self) -> int:
        with self._lock:
            return len(self._fds)

    def add(self, cpu_dir: Path, pidfd: int) -> None:
        """A sandbox about to be killed: its cpu cgroup gets the largest weight now, before the
        kill (no killed sandbox's exit competes with this write yet); ``pidfd`` is of its
        process that exits last (this object closes it)."""
        _write(cpu_dir / "cpu.shares", MAX_SHARES)
        with self._lock:
            self._fds.append(pidfd)

    def commit(self) -> None:
        """After the kills: ``prorl`` weighs as many threads as sandboxes are dying, until they are gone."""
        with self._lock:
            if not self._fds:
                return
            self._last_kill = time.monotonic()
            self._set(level(len(self._fds)))
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._watch, name="exit-boost", daemon=True)
                self._watcher.start()

    def _set(self, shares: int) -> None:
        if shares != self._shares and _write(self.parent / "cpu.shares", shares):
            self._shares = shares

    def _watch(self) -> None:
        """Poll the pidfds (a batch of exits at a time: a pause after each wake-up), lowering
        the weight as they exit, until every one exited or the boost is too old."""
        poller, watched = select.poll(), set()
        while True:
            with self._lock:
                new = [fd for fd in self._fds if fd not in watched]
                expired = time.monotonic() - self._last_kill > LONGEST_S
            for fd in new:
                poller.register(fd, select.POLLIN)
                watched.add(fd)
            exited = set(watched) if expired else {fd for fd, _ in poller.poll(100)}
            for fd in exited:
                poller.unregister(fd)
                os.close(fd)
            watched -= exited
            with self._lock:
                self._fds = [fd for fd in self._fds if fd not in exited]
                self._set(level(len(self._fds)))  # level(0) is the default weight
                if not self._fds:
                    self._watcher = None
                    return
            time.sleep(0.05)


def parent() -> Path:
    return V1_ROOT / "cpu" / PREFIX


_boost = ExitBoost(parent())  # this process's (no I/O until a sandbox is added)


def hasten(cpu_dir: Path, pidfd: int) -> None:
    """A sandbox about to be killed (its cpu cgroup, a pidfd of its process that exits last,
    which this module closes) runs before the living from :func:`commit` until it is gone."""
    _boost.add(cpu_dir, pidfd)


def commit() -> None:
    """After the kills of a close: raise the weight for the sandboxes :func:`hasten` named."""
    _boost.commit()


def reset() -> None:
    """Set the sandboxes' weight back to the default (a host's start: an earlier host may have
    died during a boost)."""
    _write(parent() / "cpu.shares", BASE_SHARES)
