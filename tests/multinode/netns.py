"""Nodes of a cluster on one machine: a network namespace, a hostname and a freezer cgroup each.

A bridge lives in a namespace of its own (the "fabric"); each node's namespace is joined to it by
a veth pair and gets ``<subnet>.<index>/24``. Nothing is added to the machine's own network
namespace, so no address of the host is used or changed. Names carry the pid of the test process
(``prorl-mn-<pid>-<node>``); :func:`remove_stale` deletes what a test process that no longer
exists left behind (a SIGKILLed pytest never reaches its ``finally``).

Processes enter a node with ``nsenter --net`` rather than ``ip netns exec``: the latter remounts
``/sys`` in a mount namespace of its own, which hides ``/sys/fs/cgroup`` and would take the
sandboxes' cgroup limits away on the "node". Each process also gets its own UTS namespace with the
node's hostname (Celery node names, sandbox host ids and the Slurm scripts' log names derive from
it), and joins the node's freezer cgroup before it execs, so that :meth:`Node.kill_all` reaches
everything started on the node, sandboxes included, however deep they fork: freeze, SIGKILL
every member, thaw (what Slurm's proctrack/cgroup does to a job).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

NETNS_DIR = Path("/run/netns")
FREEZER = Path("/sys/fs/cgroup/freezer")
SCRATCH = Path("/tmp")  # each node's local disk for workspaces: /tmp/prorl-mn-<pid>/<node>
                        # (0755: the sandboxes' unprivileged uids traverse it, unlike pytest's tmp)
PREFIX = "prorl-mn-"
_CLONE_NEWNET = 0x40000000
_ENTER = 'echo $$ > "$0" && exec "$@"'        # join the cgroup, then become the command
_NAME = 'hostname "$0" && exec "$@"'          # inside the new UTS namespace


def ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def remove_stale() -> None:
    """Namespaces and cgroups of earlier test processes that are gone."""
    names = [p.name for p in NETNS_DIR.glob(f"{PREFIX}*")] if NETNS_DIR.exists() else []
    for name in names:
        owner = name[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            _delete_netns(name)
    for group in FREEZER.glob(f"{PREFIX}*") if FREEZER.exists() else []:
        owner = group.name[len(PREFIX):]
        if owner.isdigit() and not _alive(int(owner)):
            for node in [p for p in group.iterdir() if p.is_dir()]:
                _kill_cgroup(node)
                _rmdir(node)
            _rmdir(group)
    for scratch in SCRATCH.glob(f"{PREFIX}*"):
        owner = scratch.name[len(PREFIX):]
        if owner.isdigit() and not _alive(int(owner)):
            remove_scratch(scratch)


def remove_scratch(path: Path) -> None:
    """Unmount whatever is mounted beneath ``path`` (the workspace filesystems of sandboxes
    whose host was killed), deepest first, then remove it without following links."""
    mounts = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            point = line.split()[4].replace("\\040", " ")
            if point == str(path) or point.startswith(f"{path}/"):
                mounts.append(point)
    for point in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)
    shutil.rmtree(path, ignore_errors=True)


def _delete_netns(name: str) -> None:
    for pid in _netns_pids(name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(RuntimeError):
        ip("netns", "delete", name)  # its veth ends go with it


def _netns_pids(name: str) -> list[int]:
    try:
        return [int(p) for p in ip("netns", "pids", name).split()]
    except RuntimeError:
        return []


def _members(group: Path) -> list[int]:
    try:
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _kill_cgroup(group: Path, timeout: float = 10.0) -> None:
    """Freeze the group (nothing in it runs or forks any more), SIGKILL every member, thaw."""
    state = group / "freezer.state"
    with contextlib.suppress(OSError):
        state.write_text("FROZEN")
        deadline = time.monotonic() + timeout
        while state.read_text().strip() != "FROZEN" and time.monotonic() < deadline:
            time.sleep(0.02)
    for pid in _members(group):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        state.write_text("THAWED")
    deadline = time.monotonic() + timeout
    while _members(group) and time.monotonic() < deadline:
        time.sleep(0.05)


def _rmdir(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


class Node:
    """One namespace on the fabric: its address, its hostname and its processes."""

    def __init__(self, fabric: "Fabric", name: str, index: int):
        self.fabric, self.name, self.index = fabric, name, index
        self.netns = f"{fabric.prefix}-{name}"
        self.address = f"{fabric.subnet}.{index}"
        self.cgroup = fabric.cgroup / name
        self.scratch = fabric.scratch / name
        self.procs: list[subprocess.Popen] = []
        self._pool: ThreadPoolExecutor | None = None

    def create(self) -> "Node":
        ip("netns", "add", self.netns)
        self.fabric.nodes.append(self)
        ns, fab = self.netns, self.fabric.netns
        ip("-n", fab, "link", "add", f"v{self.index}", "type", "veth", "peer", "name", "eth0",
           "netns", ns)
        ip("-n", fab, "link", "set", f"v{self.index}", "master", "br0", "up")
        ip("-n", ns, "addr", "add", f"{self.address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        self.cgroup.mkdir()
        self.scratch.mkdir(mode=0o755)
        return self

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run on this node: in its cgroup, network namespace and hostname."""
        return ["sh", "-c", _ENTER, str(self.cgroup / "cgroup.procs"),
                "nsenter", f"--net={NETNS_DIR / self.netns}", "unshare", "--uts", "--",
                "sh", "-c", _NAME, self.name, *command]

    def spawn(self, label: str, command: list[str], env: dict[str, str], log_dir: Path,
              cwd: Path | None = None) -> subprocess.Popen:
        log = open(log_dir / f"{self.name}-{label}.log", "ab")
        proc = subprocess.Popen(self.argv(command), env=env, cwd=cwd, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self.procs.append(proc)
        return proc

    def run(self, command: list[str], env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(command), env=env, capture_output=True, text=True,
                              timeout=timeout)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)`` on a thread inside this node's network namespace: the sockets it opens
        are this node's (setns moves only the calling thread)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(4, thread_name_prefix=f"netns-{self.name}",
                                            initializer=self._enter)
        return self._pool.submit(fn, *args, **kwargs).result()

    def _enter(self) -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fd = os.open(NETNS_DIR / self.netns, os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.netns}")
        finally:
            os.close(fd)

    def members(self) -> list[int]:
        """Every process started on this node that is still alive (its cgroup's members)."""
        return _members(self.cgroup)

    def netns_pids(self) -> list[int]:
        return _netns_pids(self.netns)

    def kill_all(self) -> None:
        """Every process of the node dies at once, as if it lost power."""
        _kill_cgroup(self.cgroup)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM what the test started here, wait, then kill whatever is left."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.kill_all()

    def destroy(self) -> None:
        self.kill_all()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        _delete_netns(self.netns)
        _rmdir(self.cgroup)


class Fabric:
    """The bridge namespace and the nodes on it; :meth:`destroy` removes all of it."""

    def __init__(self, subnet: str = "10.77.0"):
        self.subnet = subnet
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.netns = f"{self.prefix}-fabric"
        self.cgroup = FREEZER / self.prefix
        self.scratch = SCRATCH / self.prefix
        self.nodes: list[Node] = []
        self._lock = threading.Lock()

    def create(self) -> "Fabric":
        remove_stale()
        ip("netns", "add", self.netns)
        ip("-n", self.netns, "link", "add", "br0", "type", "bridge")
        ip("-n", self.netns, "link", "set", "br0", "up")
        self.cgroup.mkdir(exist_ok=True)
        self.scratch.mkdir(mode=0o755, exist_ok=True)
        self.scratch.chmod(0o755)
        return self

    def node(self, name: str, index: int) -> Node:
        return Node(self, name, index).create()

    def destroy(self) -> None:
        with self._lock:
            for node in self.nodes:
                node.destroy()
            self.nodes.clear()
            _delete_netns(self.netns)
            _rmdir(self.cgroup)
            remove_scratch(self.scratch)


@contextlib.contextmanager
def fabric(subnet: str = "10.77.0") -> Iterator[Fabric]:
    """A fabric that is removed on the way out, whatever happened inside."""
    made = Fabric(subnet)
    try:
        yield made.create()
    finally:
        made.destroy()


def available() -> str | None:
    """Why nodes cannot be built here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, a freezer cgroup)"
    for tool in ("ip", "nsenter", "unshare"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            return f"{tool} is not installed"
    if not (FREEZER / "cgroup.procs").exists():
        return "no cgroup v1 freezer hierarchy at /sys/fs/cgroup/freezer"
    return None
