"""A process's memory under a cgroup of its own (the run worker's: its harness sessions' gateways).

The group is made *inside* the memory cgroup the process already runs in (a Slurm job step's, a
systemd unit's, the launcher's), never at the hierarchy's root: whatever holds the whole job still
holds it, and this adds a tighter limit for the one process. Over it, the kernel kills within the
group (the process itself: SIGKILL), not elsewhere on the node.

Layout (cgroup v1, as :mod:`sandboxes.runtimes.limits.cgroups`)::

    /sys/fs/cgroup/memory/<the process's cgroup>/<prefix>-<pid>

:func:`leave` moves the process back to its parent group and removes its own; :func:`sweep`
removes what a killed process left (a group named for a pid that no longer lives, and empty).
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from sandboxes.runtimes.limits.cgroups import V1_ROOT, _write, kill_and_remove, pids_in, set_memory_limit

log = logging.getLogger(__name__)


def current_memory_cgroup(pid: int | str = "self") -> Path | None:
    """The v1 memory cgroup directory ``pid`` runs in (None where there is no v1 memory controller)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return V1_ROOT / "memory" / path.lstrip("/")
    return None


def why_not() -> str:
    """Why this process cannot have a memory cgroup of its own here ("" when it can)."""
    parent = current_memory_cgroup()
    if parent is None:
        if (V1_ROOT / "cgroup.controllers").exists():
            return "cgroup v2 (a delegated subtree) is not supported yet"
        return f"no cgroup v1 memory controller mounted under {V1_ROOT}"
    if not (parent / "cgroup.procs").exists():
        return f"its memory cgroup {parent} is not visible here"
    if not os.access(parent, os.W_OK):
        return f"it may not make cgroups under {parent} (not root, nothing delegated)"
    return ""


def place(prefix: str, memory_mb: int) -> Path:
    """Move this process (all its threads) into a new memory cgroup ``<prefix>-<pid>`` under its
    own, limited to ``memory_mb`` (see :func:`_move_charges` for what it holds already). Returns
    the group.
    Raises OSError where the node does not allow it (see :func:`why_not`)."""
    parent = current_memory_cgroup()
    if parent is None:
        raise OSError(why_not())
    sweep(prefix, parent)
    group = parent / f"{prefix}-{os.getpid()}"
    group.mkdir(exist_ok=True)
    try:
        set_memory_limit(group, memory_mb)
        _move_charges(group)
        _write(group / "cgroup.procs", os.getpid())
    except OSError:
        kill_and_remove(group, timeout=1)
        raise
    return group


def _move_charges(group: Path) -> None:
    """Have what the process holds already count in its new group, where the kernel still moves
    charges (v1's move_charge_at_immigrate; newer kernels refuse it: then only what it takes next
    counts, the few tens of MiB a worker holds at start stay with the parent group)."""
    try:
        _write(group / "memory.move_charge_at_immigrate", 1)
    except OSError:
        pass


def leave(group: Path) -> None:
    """Move this process back to the group's parent and remove the group (what is left in it,
    a child process, is killed)."""
    try:
        _write(group.parent / "cgroup.procs", os.getpid())
    except OSError as exc:
        log.warning("could not leave the memory cgroup %s: %s", group, exc)
        return
    kill_and_remove(group, timeout=2)


def sweep(prefix: str, parent: Path | None = None) -> int:
    """Remove the ``<prefix>-<pid>`` groups under ``parent`` (default: this process's own group)
    whose process is gone and which hold nothing; returns how many went. A group whose pid lives
    is left alone: a starting process makes its group before it enters it."""
    parent = parent or current_memory_cgroup()
    removed = 0
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)")
    for group in sorted(parent.glob(f"{prefix}-*/")) if parent and parent.is_dir() else []:
        found = pattern.fullmatch(group.name)
        if not found or _alive(int(found.group(1))) or pids_in(group):
            continue
        try:
            group.rmdir()
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
