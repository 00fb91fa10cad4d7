"""Reaping what dead sandbox hosts left on this node: processes, mounts, loop devices, cgroups,
workspaces. Called when a host starts (:func:`reap_leftovers`).

A host that dies by SIGKILL (alone, with its process group or session, after its guardian, or by
the OOM killer in the middle of a burst of creations) takes its sandboxes' processes along in
most cases (``bwrap --die-with-parent``, slirp4netns's exit fd), but not everything: a sandbox
whose start was between the host's fork and bwrap's ``prctl`` outlives it, and the workspace
filesystems (an ext4 image on a loop device, mounted in the host's namespace), the per-sandbox
cgroups and the workspaces stay behind whatever happened.

What is a dead host's is found by what it owned, never by a process name:

- its workspace root ``<root>/<host id>``: a host holds ``<root>/.<host id>.lock`` while it lives,
  so a lock that can be taken is a dead host's. Its sandboxes' cgroups
  (``cgroups.host_key(<root>/<host id>)``) are emptied and removed, every process whose command
  line names a path under its directory (a sandbox's outer and inner bwrap, the cgroup shim and
  setpriv before them) is killed, the mounts under it are detached, the loop devices backed by
  images under it are cleared, and the directory is deleted;
- the sandbox uids (:mod:`sandboxes.runtimes.limits.uids`): a uid whose lease nobody holds runs no live
  sandbox (a host takes the lease before it starts anything as that uid and frees it only once
  nothing runs as it), so every process of such a uid is killed, while the reaper holds the lease.
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel

from sandboxes import safedirs

from sandboxes.runtimes.limits import cgroups

log = logging.getLogger(__name__)
_LOOP_CLR_FD = 0x4C01
_MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 8
_libc = ctypes.CDLL(None, use_errno=True)
_LOCK = re.compile(r"^\.(?P<host_id>.+)\.lock$")


@dataclass(frozen=True)
class UidRange:
    """The uids one runtime gives its sandboxes, and where their leases are."""

    base: int
    count: int
    lock_dir: str


class ReapReport(BaseModel):
    hosts: list[str] = []
    killed: int = 0
    unmounted: int = 0
    loops_cleared: int = 0
    cgroups_removed: int = 0

    def any(self) -> bool:
        return bool(self.hosts or self.killed or self.unmounted or self.loops_cleared)


# -- finding ------------------------------------------------------------------------------------
def _processes() -> Iterable[tuple[int, int, bytes]]:
    """(pid, real uid, command line) of every process (a scan of /proc)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as fh:
                uid = next(int(line.split()[1]) for line in fh if line.startswith(b"Uid:"))
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except (OSError, StopIteration, ValueError):
            continue
        yield int(name), uid, cmdline


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_under(directory: Path) -> list[str]:
    """Mount points in this mount namespace at or beneath ``directory``, deepest first."""
    prefix = os.path.realpath(directory).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            point = _unescape(line.split()[4])
            if point.startswith(prefix):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def loops_under(directory: Path) -> list[str]:
    """Loop devices whose backing file is beneath ``directory``."""
    prefix = os.path.realpath(directory).rstrip("/") + "/"
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            path = backing.read_text().strip().removesuffix(" (deleted)")
        except OSError:
            continue
        if path.startswith(prefix):
            found.append(f"/dev/{backing.parent.parent.name}")
    return found


def dead_hosts(root: Path, own_host_id: str | None = None) -> list[tuple[str, int | None]]:
    """(host id, lock fd held for it or None) of every host under ``root`` that is not alive:
    its lock file can be locked (the fd keeps it so until the caller closes it).
    ``own_host_id`` (whose lock this process already holds) counts as dead."""
    found: dict[str, int | None] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        match = _LOCK.match(name)
        host_id = match.group("host_id") if match else name
        if host_id in found or (not match and (name.startswith(".") or f".{name}.lock" in names)):
            continue
        if host_id == own_host_id:
            found[host_id] = None
            continue
        if not match:  # no lock file (yet: a host makes its directory first): not ours to judge
            continue
        fd = safedirs.open_lock(root / name)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        found[host_id] = fd
    return list(found.items())


# -- killing and removing -----------------------------------------------------------------------
def _kill(pids: list[int]) -> int:
    hit = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            hit += 1
        except (ProcessLookupError, PermissionError):
            pass
    return hit


def processes_naming(directory: str | os.PathLike) -> list[int]:
    """Pids of the processes whose command line names a path beneath ``directory``."""
    needle = (str(directory).rstrip("/") + "/").encode()
    return [pid for pid, _, cmdline in _processes() if needle in cmdline and pid != os.getpid()]


def kill_naming(directory: Path, rounds: int = 5) -> int:
    """SIGKILL every process whose command line names a path beneath ``directory`` (again until
    none is left: a shim may exec into the next one while the scan runs)."""
    killed = 0
    for _ in range(rounds):
        pids = processes_naming(directory)
        if not pids:
            break
        killed += _kill(pids)
        time.sleep(0.02)
    return killed


def _unmount(point: str) -> bool:
    if _libc.umount2(point.encode(), _MNT_DETACH | _UMOUNT_NOFOLLOW) == 0:
        return True
    log.warning("could not unmount %s: %s", point, os.strerror(ctypes.get_errno()))
    return False


def _clear_loop(device: str) -> bool:
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.ioctl(fd, _LOOP_CLR_FD)
        return True
    except OSError:  # ENXIO: already free (autoclear got there first); EBUSY: still in use
        return False
    finally:
        os.close(fd)


def reap_host(root: Path, host_id: str, report: ReapReport) -> None:
    """Everything the (dead) host ``host_id`` left under ``root``."""
    directory = root / host_id
    report.cgroups_removed += cgroups.sweep(cgroups.host_key(str(directory)))
    report.killed += kill_naming(directory)
    for point in mounts_under(directory):
        report.unmounted += _unmount(point)
    deadline = time.monotonic() + 2.0  # autoclear frees a device once its last user is gone
    while (loops := loops_under(directory)) and time.monotonic() < deadline:
        report.loops_cleared += sum(_clear_loop(device) for device in loops)
        time.sleep(0.05)
    if directory.is_dir():
        for child in list(directory.iterdir()):
            safedirs.remove_tree(child)


def kill_unleased_uids(ranges: Iterable[UidRange]) -> int:
    """Kill every process running as a sandbox uid whose lease nobody holds; returns how many."""
    ranges = list(ranges)
    by_uid: dict[int, list[int]] = {}
    for pid, uid, _ in _processes():
        if any(r.base <= uid < r.base + r.count for r in ranges):
            by_uid.setdefault(uid, []).append(pid)
    killed = 0
    for uid, pids in sorted(by_uid.items()):
        lease = next(r for r in ranges if r.base <= uid < r.base + r.count)
        fd = safedirs.open_lock(os.path.join(lease.lock_dir, str(uid)))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live host's sandbox
        try:
            for _ in range(5):  # a process forked meanwhile is found by the next scan
                killed += _kill(pids)
                time.sleep(0.02)
                pids = [pid for pid, owner, _ in _processes() if owner == uid]
                if not pids:
                    break
        finally:
            os.close(fd)
    return killed


def uid_ranges(runtime_config: dict[str, dict[str, Any]] | None) -> list[UidRange]:
    """The bwrap runtime's uid range (only a root host gives sandboxes uids of their own)."""
    if os.geteuid() != 0:
        return []
    from sandboxes.runtimes.bwrap import BwrapConfig
    from sandboxes.runtimes.limits.uids import checked_lock_dir, default_lock_dir

    cfg = (runtime_config or {}).get("bwrap") or {}
    config = BwrapConfig.model_validate({k: v for k, v in cfg.items() if k in BwrapConfig.model_fields})
    lock_dir = checked_lock_dir(config.uid_lock_dir or default_lock_dir())
    return [UidRange(config.uid_base, config.uid_count, str(lock_dir))]


def reap_leftovers(roots: Iterable[str | os.PathLike], own_host_id: str | None = None,
                   runtime_config: dict[str, dict[str, Any]] | None = None) -> ReapReport:
    """Reap what dead hosts left under each workspace root (and this host's own earlier run,
    ``own_host_id``), and the processes of unleased sandbox uids. Never raises: a host must
    start even when a leftover cannot be removed (it is logged)."""
    report = ReapReport()
    for root in dict.fromkeys(Path(r) for r in roots):
        try:
            for host_id, fd in dead_hosts(root, own_host_id):
                try:
                    reap_host(root, host_id, report)
                    if host_id != own_host_id:
                        report.hosts.append(host_id)
                        for stale in (root / host_id, root / f".{host_id}.lock"):
                            stale.rmdir() if stale.is_dir() else stale.unlink(missing_ok=True)
                finally:
                    if fd is not None:
                        os.close(fd)
        except OSError as exc:
            log.warning("reaping under %s stopped: %s", root, exc)
    try:
        report.killed += kill_unleased_uids(uid_ranges(runtime_config))
    except OSError as exc:
        log.warning("reaping sandbox uids stopped: %s", exc)
    if report.any():
        log.warning("reaped what dead sandbox hosts left: %s", report.model_dump())
    return report
