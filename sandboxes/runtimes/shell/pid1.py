"""The persistent shell of a sandbox whose pid 1 is a process of its own (``bwrap``, or
``apptainer exec``): the command's processes are everything in the sandbox but that pid 1 and
bash, and killing that pid 1 makes the kernel kill everything in the sandbox's pid namespace.
Shared by :mod:`sandboxes.runtimes.bwrap` and :mod:`sandboxes.runtimes.singularity`."""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

from sandboxes.runtimes.limits.netns import UserNet, attach, open_low_ports
from sandboxes.runtimes.procs import child_pids, kill_descendants, readable
from sandboxes.runtimes.shell.persistent import PersistentShell
from sandboxes.runtimes.shell.script import shell_quote


class BwrapShell(PersistentShell):
    """A persistent shell whose command processes are everything in the sandbox but bash.

    ``inner_env`` (the request's variables) is exported by the shell itself on every start,
    before any command: it never is the environment or the command line of a host-side
    process. With ``network``, each start (restarts too) gets its own :class:`UserNet`."""

    _init_pid: int | None = None
    _bash_pid: int | None = None
    _init_fd: int | None = None  # a pidfd: signals reach that process even once its pid is reused
    net: UserNet | None = None
    cgroup_kill: Any = None  # SandboxCgroup.kill_except, where the sandbox has a cgroup

    def __init__(self, argv: list[str], *, inner_env: dict[str, str] | None = None,
                 network: bool = False, low_ports: bool = False, **kwargs: Any):
        self.inner_env = dict(inner_env or {})
        self.network = network
        self.low_ports = low_ports
        super().__init__(argv, **kwargs)

    @property
    def shell_pid(self) -> int | None:
        return self._bash_pid or self.pid

    def _start_commands(self) -> list[str]:
        exports = [f"builtin export {name}={shell_quote(value)}" for name, value in self.inner_env.items()]
        return exports + super()._start_commands()

    def adopt(self, env, limits, cwd) -> None:
        """As :meth:`PersistentShell.adopt`, but the variables are kept for the shell inside
        (exported again after a restart), never put into the host-side start's environment."""
        host_env = dict(self.env)
        try:
            super().adopt(env, limits, cwd)
        finally:
            self.env = host_env
        self.inner_env.update(env)

    def _started(self) -> None:
        inits = child_pids(self._proc.pid)
        bashes = child_pids(inits[0]) if len(inits) == 1 else []
        if len(bashes) != 1:
            raise OSError(f"unexpected bwrap process tree: {inits} -> {bashes}")
        self._init_pid, self._bash_pid = inits[0], bashes[0]
        try:
            self._init_fd = os.pidfd_open(self._init_pid)
        except OSError:  # kernel < 5.3: signal by pid while the outer bwrap still runs
            self._init_fd = None
        if self.low_ports:  # an image's service may listen on port 80, as in its container
            open_low_ports(self._init_pid)
        if self.network:  # before any command ran in it: not usable without its network
            self.net = attach(self._init_pid, self._init_fd)

    def namespace(self, kind: str = "net") -> int | None:
        """A new descriptor of the sandbox's ``kind`` namespace (the caller closes it); None when
        the sandbox is not running."""
        if self._init_pid is None:
            return None
        fd = os.open(f"/proc/{self._init_pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        if self._init_fd is not None and readable((self._init_fd,), 0):  # exited: the pid may be another's
            os.close(fd)
            return None
        return fd

    def _kill_command(self) -> list[int]:
        if self._init_pid is None:
            return super()._kill_command()
        # Also orphans (of setsid, of killed parents). A child forked while a walk runs is
        # reparented to pid 1 after the walk read pid 1's children: walk again until none is new.
        killed: list[int] = []
        for _ in range(5):
            new = [pid for pid in kill_descendants(self._init_pid, spare=self._bash_pid) if pid not in killed]
            if not new:
                break
            killed += new
        if self.cgroup_kill:  # the cgroup lists every process the command forked, raced or not
            killed += self.cgroup_kill({self._proc.pid, self._init_pid, self._bash_pid})
        return killed

    def _kill_all(self) -> list[int]:
        """SIGKILL the sandbox's pid 1: the kernel kills all in its pid namespace, and the outer
        bwrap exits once they are gone, so reaping it proves the whole tree is dead."""
        if self._proc is None:
            return []
        try:
            if self._init_fd is not None:
                signal.pidfd_send_signal(self._init_fd, signal.SIGKILL)
            elif self._init_pid is not None and self._proc.poll() is None:
                os.kill(self._init_pid, signal.SIGKILL)
            else:
                raise ProcessLookupError
        except ProcessLookupError:
            self._proc.kill()  # our unreaped child: its die-with-parent takes the rest along
        return []

    def _reap(self) -> None:
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        super()._reap()
        if self.net is not None:  # its namespace is gone with the sandbox: slirp4netns goes too
            self.net.close()
            self.net = None
        if self._init_fd is not None:
            os.close(self._init_fd)
        self._init_fd = self._init_pid = self._bash_pid = None


def tree_info(shell: BwrapShell | None) -> dict[str, Any]:
    """The pids of a :class:`BwrapShell`'s sandbox: its pid 1 and its bash."""
    return {"init_pid": shell._init_pid if shell else None,
            "shell_pid": shell.shell_pid if shell else None}
