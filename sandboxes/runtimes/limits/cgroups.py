"""One cgroup per sandbox: memory, process count and CPU of the whole sandbox, not per process.

Rlimits count per process (``RLIMIT_AS``) or per uid (``RLIMIT_NPROC``), so eight processes of
512 MiB each, or a tmpfs full of files, slip past them. A cgroup counts everything its members
hold, tmpfs pages included (the kernel charges a tmpfs page to the cgroup of the process that
first touches it), and the kernel kills inside the group when it is over its memory.

Layout (cgroup v1, one hierarchy per controller, as on this node)::

    /sys/fs/cgroup/<memory|pids|cpu>/prorl/<host key>/<sandbox name>

A sandbox's outer process enters its cgroup before it execs anything (:meth:`SandboxCgroup.
enter_argv`: a ``/bin/sh`` shim writes its own pid, then execs the real argv), so nothing the
sandbox forks is ever outside. :meth:`SandboxCgroup.remove` kills what is left in it and removes
it; :func:`sweep` removes what a dead host left. A delegated cgroup v2 subtree (Slurm) is detected
and reported as not enforced (see :func:`enforcement`).

What a sandbox used (:meth:`SandboxCgroup.usage`: its CPU-seconds from ``cpuacct.usage``, its peak
memory from ``memory.max_usage_in_bytes``) is read from the same groups: ``cpuacct`` is joined
beside them where it is a hierarchy of its own (``/sys/fs/cgroup/cpuacct/prorl/...``), or read
in the cpu group where the node mounts ``cpu,cpuacct`` together (:func:`accounting`).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import signal
import time
from pathlib import Path

from prorl_celery.errors import SandboxError
from sandboxes.base import Limits
from sandboxes.runtimes.limits.mountns import JOIN_CGROUPS

log = logging.getLogger(__name__)

V1_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")
PREFIX = "prorl"
CFS_PERIOD_US = 100_000
_MB = 1 << 20
_SHIM = JOIN_CGROUPS + 'exec "$@"'


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:100] or "_"


@functools.cache
def controllers() -> tuple[str, ...]:
    """The v1 controllers this process may make cgroups in (all of CONTROLLERS, or none)."""
    from config.settings import get_settings

    if os.geteuid() != 0 or not get_settings().sandbox_cgroups:
        return ()
    found = tuple(name for name in CONTROLLERS if (V1_ROOT / name / "cgroup.procs").exists()
                  and not (V1_ROOT / name / "cgroup.subtree_control").exists())
    return found if found == CONTROLLERS else ()


@functools.cache
def accounting() -> str | None:
    """The hierarchy that counts a sandbox's CPU time: ``cpu`` where cpuacct is mounted with it,
    ``cpuacct`` where it is a hierarchy of its own, None where there is none (or no cgroups)."""
    if not controllers():
        return None
    if (V1_ROOT / "cpu" / "cpuacct.usage").exists():
        return "cpu"
    acct = V1_ROOT / "cpuacct"
    if (acct / "cpuacct.usage").exists() and (acct / "cgroup.procs").exists() \
            and not (acct / "cgroup.subtree_control").exists():
        return "cpuacct"
    return None


def why_not() -> str:
    """Why sandboxes get no cgroup on this node ("" when they do)."""
    if controllers():
        return ""
    from config.settings import get_settings

    if not get_settings().sandbox_cgroups:
        return "turned off (sandbox_cgroups=false)"
    if os.geteuid() != 0:
        return "the sandbox host is not root"
    if (V1_ROOT / "cgroup.controllers").exists():
        return "cgroup v2 (a delegated subtree) is not supported yet"
    missing = [name for name in CONTROLLERS if not (V1_ROOT / name / "cgroup.procs").exists()]
    return f"cgroup v1 controllers {missing} are not mounted under {V1_ROOT}"


def _write(path: Path, value: str | int) -> None:
    with open(path, "w") as fh:
        fh.write(str(value))


def pids_in(directory: Path) -> list[int]:
    try:
        return [int(line) for line in (directory / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_and_remove(directory: Path, timeout: float = 5.0) -> bool:
    """SIGKILL every member (again, until none is left: a fork loop is held by pids.max), then
    rmdir. True when the cgroup is gone."""
    deadline = time.monotonic() + timeout
    while True:
        pids = pids_in(directory)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            directory.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= deadline:
                log.warning("cgroup %s still busy (members %s)", directory, pids[:10])
                return False
            time.sleep(0.005)


def set_memory_limit(memory: Path, memory_mb: int | None) -> None:
    """A v1 memory cgroup's limit (None: none), swap included where the node counts it."""
    limit = memory_mb * _MB if memory_mb else -1
    memsw = memory / "memory.memsw.limit_in_bytes"
    if memsw.exists():
        _write(memsw, -1)  # memsw >= limit at every step; then no swap beyond the limit
    _write(memory / "memory.limit_in_bytes", limit)
    if memsw.exists():
        _write(memsw, limit)


class SandboxCgroup:
    """The cgroups (one per controller) of one sandbox, made when constructed."""

    def __init__(self, host_key: str, name: str):
        joined = controllers() + (("cpuacct",) if accounting() == "cpuacct" else ())
        self.dirs = {ctrl: V1_ROOT / ctrl / PREFIX / _safe(host_key) / _safe(name) for ctrl in joined}
        for directory in self.dirs.values():
            directory.mkdir(parents=True, exist_ok=True)

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes its pid into to join this cgroup."""
        return [str(directory / "cgroup.procs") for directory in self.dirs.values()]

    def enter_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run by a shim that first moves itself into this cgroup (then execs it)."""
        return ["/bin/sh", "-c", _SHIM, "sh", *self.procs_files(), "--", *argv]

    def apply(self, limits: Limits) -> None:
        """Set (or change, when a warm sandbox is claimed) the limits of the whole sandbox."""
        memory, pids, cpu = (self.dirs[ctrl] for ctrl in CONTROLLERS)
        set_memory_limit(memory, limits.memory_mb)
        _write(pids / "pids.max", limits.pids or "max")
        _write(cpu / "cpu.cfs_period_us", CFS_PERIOD_US)
        _write(cpu / "cpu.cfs_quota_us", int(limits.cpus * CFS_PERIOD_US) if limits.cpus else -1)

    def members(self) -> list[int]:
        return pids_in(self.dirs["pids"])

    def kill_except(self, spare: set[int], timeout: float = 2.0) -> list[int]:
        """SIGKILL every member but ``spare`` until none is left (pids.max bounds a fork loop)."""
        killed: list[int] = []
        deadline = time.monotonic() + timeout
        while (doomed := [pid for pid in self.members() if pid not in spare]) and \
                time.monotonic() < deadline:
            for pid in doomed:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.002)
        return killed

    def stat(self, ctrl: str, name: str) -> str:
        return (self.dirs[ctrl] / name).read_text().strip()

    def usage(self) -> dict[str, float | None] | None:
        """What the sandbox used so far: CPU-seconds of all its processes, dead ones included
        (None where no hierarchy counts them), and the peak of its memory cgroup's usage (MiB: its
        processes, their page cache and tmpfs pages). None when the group is gone."""
        acct = accounting()
        try:
            peak = int(self.stat("memory", "memory.max_usage_in_bytes"))
            cpu_ns = int(self.stat(acct, "cpuacct.usage")) if acct else None
        except (OSError, ValueError, KeyError):
            return None
        return {"cpu_s": None if cpu_ns is None else round(cpu_ns / 1e9, 6),
                "peak_memory_mb": round(peak / _MB, 3)}

    def remove(self) -> None:
        for directory in self.dirs.values():
            kill_and_remove(directory)


def rlimits_for(limits: Limits, own_uid: bool) -> Limits:
    """The rlimits the shell sets, given what the cgroup (when there is one) already holds:
    no address-space limit under a memory cgroup (it breaks runtimes that reserve address space
    and says nothing about the sum); RLIMIT_NPROC of the sandbox's own uid and RLIMIT_FSIZE as
    fallbacks where there is no pids cgroup or no workspace filesystem."""
    update: dict = {}
    if controllers():
        update["memory_mb"] = None
    elif own_uid and limits.pids and not limits.nproc:
        update["nproc"] = limits.pids
    if not workspace_quota() and limits.disk_mb and not limits.fsize_mb:
        update["fsize_mb"] = limits.disk_mb
    return limits.model_copy(update=update)


def workspace_quota() -> bool:
    """Whether workspaces get a size-capped filesystem of their own (see sandboxes.runtimes.workspace)."""
    from sandboxes.runtimes.workspace import quota_supported

    return quota_supported()


def host_key(root: str | None) -> str:
    """The cgroup directory of the sandboxes under one workspace root: its name plus a hash of
    its path (two hosts of one id under different roots, as parallel test runs are, stay apart)."""
    if not root:
        return f"pid-{os.getpid()}"
    path = os.path.realpath(root)
    return f"{os.path.basename(path)}-{hashlib.sha1(path.encode()).hexdigest()[:10]}"


def sweep(host_key: str) -> int:
    """At host start, for each of its workspace roots (``host_key(root)``): remove the cgroups an
    earlier run left (killing what is still in them; the host holds that root's lock), and the
    empty directories of other host ids (never their sandboxes' cgroups: a live host may have
    made one an instant ago, before its first process entered it). Returns how many went."""
    removed = 0
    for ctrl in controllers() + (("cpuacct",) if accounting() == "cpuacct" else ()):
        base = V1_ROOT / ctrl / PREFIX
        own = base / _safe(host_key)
        for directory in sorted(own.glob("*/")) if own.is_dir() else []:
            removed += kill_and_remove(directory, timeout=2)
        for directory in sorted(base.glob("*/")) if base.is_dir() else []:
            try:
                directory.rmdir()  # only a host directory without sandboxes
                removed += 1
            except OSError:
                pass
    return removed


@functools.cache
def enforcement() -> dict[str, str]:
    """Limit name -> how it is enforced for bwrap sandboxes on this node (for /healthz)."""
    from config.settings import get_settings
    from sandboxes.runtimes.workspace import quota_why_not

    cg, why, root = bool(controllers()), why_not(), os.geteuid() == 0
    disk_why = quota_why_not()
    return {
        "memory_mb": "cgroup v1 memory: all processes and their tmpfs pages" if cg
        else f"rlimit RLIMIT_AS per process, not their sum ({why})",
        "pids": "cgroup v1 pids" if cg else "rlimit RLIMIT_NPROC of the sandbox's own uid"
        if root else f"not enforced: {why}, sandboxes share the host's uid",
        "cpus": "cgroup v1 cpu: CFS quota" if cg else f"not enforced: {why}",
        "disk_mb": "ext4 on a loop device per sandbox workspace" if not disk_why
        else f"rlimit RLIMIT_FSIZE per file, not the total ({disk_why})",
        "tmp": "size-capped tmpfs (bwrap --size)" + (", counted in memory_mb" if cg else ""),
        "nproc": "rlimit RLIMIT_NPROC per uid",
        "nofile": "rlimit RLIMIT_NOFILE per process",
        "cpu_s": "rlimit RLIMIT_CPU per process",
        "fsize_mb": "rlimit RLIMIT_FSIZE per file",
        "wall_s": "the sandbox host closes the sandbox",
        "output": f"head and tail kept: {get_settings().output_limit_chars} characters",
        "file_read": f"host file reads capped at {read_cap_mb()} MiB",
    }


def read_cap_mb() -> int:
    from sandboxes.runtimes.workspace import read_cap_bytes

    return read_cap_bytes() // _MB


class SandboxLimits:
    """What holds one bwrap sandbox's limits: its cgroup and its workspace filesystem (each
    where the node gives it), and the rlimits its shell sets for the rest."""

    def __init__(self, workspace, limits: Limits, root: str | None, own_uid: bool):
        self.own_uid = own_uid
        self.workspace_dir = str(workspace.host_dir)
        self.cgroup: SandboxCgroup | None = None
        self.final: dict[str, float | None] | None = None  # the last reading, taken at close
        if controllers():
            self.cgroup = SandboxCgroup(host_key(root), workspace.host_dir.name)
            self.cgroup.apply(limits)
        if limits.disk_mb and workspace_quota():
            try:
                workspace.mount_quota(limits.disk_mb)
            except OSError as exc:
                self.close()
                raise SandboxError(f"could not make the workspace filesystem: {exc}") from exc

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` in the sandbox's cgroup and, on a host that keeps workspace filesystems
        out of the node's mount table (:mod:`sandboxes.runtimes.limits.mountns`), started from that
        table with only its own workspace mounted."""
        from sandboxes.runtimes.limits.diskquota import device_of
        from sandboxes.runtimes.limits.mountns import applies, enter_argv

        device = device_of(Path(self.workspace_dir))
        if applies(device):  # the mount's shim joins the cgroup too
            join = self.cgroup.procs_files() if self.cgroup else []
            return enter_argv(argv, device, self.workspace_dir, join)
        return self.cgroup.enter_argv(argv) if self.cgroup else argv

    def rlimits(self, limits: Limits) -> Limits:
        return rlimits_for(limits, self.own_uid)

    def kill_except(self, spare: set[int]) -> list[int]:
        return self.cgroup.kill_except(spare) if self.cgroup else []

    def claim(self, limits: Limits) -> None:
        if self.cgroup:
            self.cgroup.apply(limits)

    def usage(self) -> dict[str, float | None] | None:
        """Its cgroup's reading (:meth:`SandboxCgroup.usage`): now while it lives, the one taken
        just before its removal after; None where it has none."""
        return self.cgroup.usage() if self.cgroup else self.final

    def close(self) -> None:
        if self.cgroup:
            self.final = self.cgroup.usage() or self.final
            self.cgroup.remove()
            self.cgroup = None


def warm_limits(limits: Limits) -> Limits:
    """A pre-started sandbox's limits: only what cannot change later (its workspace size); the
    rest is set when it is claimed (a shell cannot raise its own hard rlimits)."""
    return Limits(memory_mb=None, cpus=None, pids=None, nofile=None, disk_mb=limits.disk_mb)
