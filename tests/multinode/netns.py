"""Nodes of a cluster on one machine: a network namespace, a hostname and a freezer cgroup each.

A bridge lives in a namespace of its own (the "fabric"); each node's namespace is joined to it by
a veth pair and gets ``<subnet>.<index>/24``. Nothing is added to the machine's own network
namespace, so no address of the host is used or changed. Names carry the pid of the test process
(``prorl-mn-<pid>-<node>``); :func:`remove_stale` deletes what a test process that no longer
exists left behind (a SIGKILLed pytest never reaches its ``finally``).

Each namespace is held by a process of its own (``unshare --net sleep``, marked with its name in
its environment) and reached as ``/proc/<holder>/ns/net``, never through ``ip netns``'s
``/run/netns`` mounts: slirp4netns ``--enable-sandbox`` (any network sandbox started on the
machine) unmounts every mount beneath ``/run/netns`` on the host when ``/run`` is not a mount
point of its own (it leaves a shared ``/run/netns`` shared in its sandbox, then detaches its old
root), which took a running cluster's namespaces away mid-test (``setns``: EINVAL).

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

NETNS_DIR = Path("/run/netns")  # where earlier versions of this module kept their namespaces
HOLDER_ENV = "PRORL_MN_NETNS"     # a holder process's mark: the name of the namespace it holds
FREEZER = Path("/sys/fs/cgroup/freezer")
SCRATCH = Path("/tmp")  # each node's local disk for workspaces: /tmp/prorl-mn-<pid>/<node>
                        # (0755: the sandboxes' unprivileged uids traverse it, unlike pytest's tmp)
PREFIX = "prorl-mn-"
_CLONE_NEWNET = 0x40000000
_ENTER = 'echo $$ > "$0" && exec "$@"'        # join the cgroup, then become the command
_NAME = 'hostname "$0" && exec "$@"'          # inside the new UTS namespace


def _run(argv: list[str]) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")
    return out.stdout


def ip(*args: str) -> str:
    return _run(["ip", *args])


def ip_in(path: str, *args: str) -> str:
    """``ip ARGS`` inside the network namespace at ``path``."""
    return _run(["nsenter", f"--net={path}", "ip", *args])


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def _owner_gone(name: str) -> bool:
    owner = name[len(PREFIX):].split("-", 1)[0]
    return owner.isdigit() and not _alive(int(owner))


def remove_stale() -> None:
    """Namespaces and cgroups of earlier test processes that are gone."""
    names = [p.name for p in NETNS_DIR.glob(f"{PREFIX}*")] if NETNS_DIR.exists() else []
    for name in names:
        if _owner_gone(name):
            _delete_netns(name)
    for holder, name in _holders():
        if _owner_gone(name):
            _release(holder)
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


def _holders() -> list[tuple[int, str]]:
    """Live holder processes of this module's namespaces: (pid, namespace name)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, OSError):
            with open(f"/proc/{proc.pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            mark = next((e for e in env if e.startswith(f"{HOLDER_ENV}=".encode())), None)
            if mark is not None:
                found.append((proc.pid, mark.split(b"=", 1)[1].decode()))
    return found


def _ns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _pids_in(inode: int | None, but: int | None = None) -> list[int]:
    """Every process in the network namespace ``inode`` (``but`` left out)."""
    if inode is None:
        return []
    return [proc.pid for proc in psutil.process_iter(["pid"])
            if proc.pid != but and _ns_inode(f"/proc/{proc.pid}/ns/net") == inode]


def _release(holder: int) -> None:
    """Kill every process in ``holder``'s namespace, then the holder: the namespace goes with it
    (and its veth ends)."""
    inode = _ns_inode(f"/proc/{holder}/ns/net")
    for pid in _pids_in(inode, but=holder) + [holder]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _hold(name: str) -> tuple[subprocess.Popen, str]:
    """A new network namespace, held by a process of its own: (the holder, its namespace's path)."""
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), HOLDER_ENV: name}
    proc = subprocess.Popen(["unshare", "--net", "--", "sleep", "2147483647"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    path, ours = f"/proc/{proc.pid}/ns/net", _ns_inode("/proc/self/ns/net")
    deadline = time.monotonic() + 30
    while _ns_inode(path) in (None, ours):  # until unshare has entered the new namespace
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"cannot make network namespace {name}: {proc.stderr.read().decode()[-300:]}")
        time.sleep(0.01)
    return proc, path


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
        self.holder: subprocess.Popen | None = None
        self.path = ""  # /proc/<holder>/ns/net

    def create(self) -> "Node":
        self.holder, self.path = _hold(self.netns)
        self.fabric.nodes.append(self)
        fab = self.fabric.path
        ip_in(fab, "link", "add", f"v{self.index}", "type", "veth", "peer", "name", "eth0",
              "netns", str(self.holder.pid))
        ip_in(fab, "link", "set", f"v{self.index}", "master", "br0", "up")
        ip_in(self.path, "addr", "add", f"{self.address}/24", "dev", "eth0")
        ip_in(self.path, "link", "set", "eth0", "up")
        ip_in(self.path, "link", "set", "lo", "up")
        self.cgroup.mkdir()
        self.scratch.mkdir(mode=0o755)
        return self

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run on this node: in its cgroup, network namespace and hostname."""
        return ["sh", "-c", _ENTER, str(self.cgroup / "cgroup.procs"),
                "nsenter", f"--net={self.path}", "unshare", "--uts", "--",
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
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.netns}")
        finally:
            os.close(fd)

    def members(self) -> list[int]:
        """Every process started on this node that is still alive (its cgroup's members)."""
        return _members(self.cgroup)

    def netns_pids(self) -> list[int]:
        """Every process in this node's network namespace but its holder."""
        return _pids_in(_ns_inode(self.path), but=self.holder.pid if self.holder else None)

    def exists(self) -> bool:
        """Whether the namespace is still there (its holder alive)."""
        return self.holder is not None and self.holder.poll() is None

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
        _destroy_holder(self.holder)
        _rmdir(self.cgroup)


def _destroy_holder(holder: subprocess.Popen | None) -> None:
    if holder is None or holder.poll() is not None:
        return
    _release(holder.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        holder.wait(timeout=10)


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
        self.holder: subprocess.Popen | None = None
        self.path = ""

    def create(self) -> "Fabric":
        remove_stale()
        self.holder, self.path = _hold(self.netns)
        ip_in(self.path, "link", "add", "br0", "type", "bridge")
        ip_in(self.path, "link", "set", "br0", "up")
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
            _destroy_holder(self.holder)
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
