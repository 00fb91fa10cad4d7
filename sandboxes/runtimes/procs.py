"""Process-tree helpers that read only the tree they are asked about.

``psutil.Process.children()`` scans every process on the machine; on a busy node that is the
largest cost of closing a sandbox. The kernel's ``/proc/<pid>/task/<tid>/children`` lists one
process's children directly, so walking a sandbox's tree reads a handful of small files.
"""
from __future__ import annotations

import math
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence

import psutil

from sandboxes.base import Limits

_HAVE_CHILDREN_FILE = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def run_bounded(argv: list[str], timeout: float, **popen) -> subprocess.CompletedProcess:
    """Run a helper command in its own session with captured output; past ``timeout`` its whole
    process group is killed and :class:`subprocess.TimeoutExpired` is raised."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (of all its threads); [] when it is gone."""
    if not _HAVE_CHILDREN_FILE:
        try:
            return [child.pid for child in psutil.Process(pid).children()]
        except psutil.Error:
            return []
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                found.extend(int(x) for x in fh.read().split())
        except OSError:
            continue
    return found


def readable(fds: Sequence[int], timeout: float | None) -> list[int]:
    """Those of ``fds`` readable, at end of file or in error within ``timeout`` seconds (None:
    no limit). poll(2), not select(2): select refuses descriptors past 1023, which a host
    serving a few hundred sandboxes (five descriptors each) or a worker of a thousand threads
    reaches."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLPRI)
    wait_ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return [fd for fd, _ in poller.poll(wait_ms)]


def descendant_pids(pid: int) -> list[int]:
    """Every descendant of ``pid``, parents before children."""
    out: list[int] = []
    todo = child_pids(pid)
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(child_pids(current))
    return out


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> list[int]:
    """Signal each pid that still exists; returns those signalled."""
    hit = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            hit.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return hit


def kill_descendants(pid: int, spare: int | None = None) -> list[int]:
    """SIGKILL every descendant of ``pid`` (not ``pid`` itself, nor ``spare``, though the
    descendants of ``spare`` too); returns those signalled.

    Stops each process before reading its children, so a fork loop cannot outrun the walk."""
    hit: list[int] = []
    todo = child_pids(pid)
    while todo:
        current = todo.pop()
        if current == spare:
            todo.extend(child_pids(current))
        elif kill_pids([current], signal.SIGSTOP):
            todo.extend(child_pids(current))
            hit.append(current)
    return kill_pids(hit)


def proc_stats(cmdline: bool = False) -> Iterator[tuple[int, list[bytes], bytes]]:
    """(pid, the fields of ``/proc/<pid>/stat`` after the command name, the command line or b"")
    of every process /proc shows now (a scan: for timeouts and tools, not the hot path)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
            argv = b""
            if cmdline:
                with open(f"/proc/{name}/cmdline", "rb") as fh:
                    argv = fh.read()
        except OSError:
            continue
        yield int(name), stat[stat.rfind(b")") + 2:].split(), argv


def group_members(pgid: int) -> list[int]:
    """Processes in process group ``pgid``."""
    return [pid for pid, fields, _ in proc_stats() if len(fields) > 2 and int(fields[2]) == pgid]


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a zombie is dead; its reaper may be slow)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2: stat.rfind(b")") + 3] not in (b"Z", b"X")


def wait_dead(pids: list[int], timeout: float) -> bool:
    """Wait until none of ``pids`` is alive; True if that happened within ``timeout``."""
    deadline = time.monotonic() + timeout
    pending = list(pids)
    while True:
        pending = [pid for pid in pending if alive(pid)]
        if not pending or time.monotonic() >= deadline:
            return not pending
        time.sleep(0.005)


def ulimit_command(limits: Limits) -> str | None:
    """A bash ``ulimit`` setting soft and hard limits for the shell and all it starts.

    Run by the shell itself: it needs no privilege over the shell's process (a host without
    CAP_SYS_RESOURCE cannot ``prlimit`` a sandbox running as another uid), and no preexec_fn
    (which forces ``fork`` of the whole host instead of ``vfork``). Nothing in the sandbox can
    raise a hard limit again."""
    flags = [("-v", limits.memory_mb and limits.memory_mb * 1024),
             ("-t", limits.cpu_s), ("-u", limits.nproc),
             ("-f", limits.fsize_mb and limits.fsize_mb * 1024), ("-n", limits.nofile)]
    parts = [f"{flag} {int(value)}" for flag, value in flags if value]
    return f"ulimit -S -H {' '.join(parts)}" if parts else None
