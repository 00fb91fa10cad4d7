"""``ShellSandbox``: what the three runtimes share. A sandbox is one persistent shell and one
workspace on the host; commands go to the shell, files to the workspace. Each runtime states
only what differs: how its shell starts, where the workspace appears (``_workdir``), what a claim
does to its limits, what else it holds until close, and what its ``info()`` adds.
"""
from __future__ import annotations

import time

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prorl_celery.errors import SandboxGone
from sandboxes.base import ExecResult, Limits, SandboxRuntime, SandboxSpec
from sandboxes.protocol import FinishResponse
from sandboxes.runtimes.shell.persistent import PersistentShell
from sandboxes.runtimes.shell.spawn import DEFAULT_ARGV
from sandboxes.runtimes.limits.uids import UidLease, lease_uid
from sandboxes.runtimes.export import export_tar, locate, read_files, stamps
from sandboxes.runtimes.workspace import Workspace, WorkspaceFiles, read_cap_bytes


class ShellConfig(BaseModel):
    """What the config of every shell-backed runtime has."""

    model_config = ConfigDict(extra="forbid")

    root: str | None = Field(None, description="Host directory under which workspaces are made; "
                                                "default: the system temp directory.")
    shell: list[str] = Field(list(DEFAULT_ARGV), description="argv of the persistent shell.")


class IsolatedConfig(ShellConfig):
    """A runtime whose sandbox sees its workspace at ``mount`` and, where the host is root, runs
    as a host uid of its own (bwrap and singularity lease from the same range: one lease)."""

    mount: str = Field("/workspace", description="Where the workspace appears in the sandbox.")
    hostname: str = Field("sandbox", description="Hostname inside the sandbox.")
    uid_base: int = Field(1_000_000, description="First host uid given to sandboxes when the "
                                                 "host runs as root.")
    uid_count: int = Field(65536, description="How many uids from uid_base may be used.")
    uid_lock_dir: str | None = Field(None, description="Lock files of the uids in use; default: "
                                                       "<tmp>/prorl-sandbox-uids.")


def _settle(bases: dict, paths: list[str], mount: str, settle_s: float) -> list[str]:
    """The paths whose file changed during ``settle_s`` seconds of watching (polled every 20 ms)."""
    if settle_s <= 0:
        return []
    first = stamps(bases, paths, mount)
    changed: set[str] = set()
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = stamps(bases, paths, mount)
        changed |= {p for p in set(first) | set(now) if first.get(p) != now.get(p)}
    return sorted(changed)


class ShellSandbox(WorkspaceFiles, SandboxRuntime):
    """The :class:`~sandboxes.base.Sandbox` protocol on ``self.shell`` and ``self.workspace``."""

    spec: SandboxSpec
    job_id: str
    workspace: Workspace
    workdir: Any  # the shell's start directory, as the runtime names it (inside or on the host)
    shell: PersistentShell | None = None
    _uid: UidLease | None = None

    def _workdir(self, workdir: str | None) -> Any:
        """Where the shell starts for a spec's ``workdir`` (made in the workspace when inside)."""
        raise NotImplementedError

    def _claim_limits(self, limits: Limits) -> Limits:
        """The rlimits the shell sets once a warm sandbox is claimed with ``limits``."""
        return limits

    def _lease_uid(self, config: IsolatedConfig) -> int | None:
        """A host uid of the sandbox's own, where the host is root (released on close)."""
        if os.geteuid() == 0:
            self._uid = lease_uid(config.uid_base, config.uid_count, config.uid_lock_dir)
        return self._uid.uid if self._uid else None

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        return self.shell.run(command, timeout)

    def interrupt(self) -> None:
        self.shell.interrupt()

    def claim(self, job_id: str, spec: SandboxSpec) -> None:
        """Hand a pre-started sandbox to ``job_id``: its env, limits and workdir."""
        workdir = self._workdir(spec.workdir)
        limits = self._claim_limits(spec.limits)
        self.shell.adopt(spec.env, limits, str(workdir) if spec.workdir else None)
        self.spec, self.job_id, self.workdir = spec, job_id, workdir

    def _bases(self) -> dict[str, str | int]:
        """Where the host reads the sandbox's trees (:mod:`sandboxes.runtimes.export`): its
        mount point inside -> host directory, or a descriptor of one that the caller closes.
        Default: the workspace."""
        return {self.workspace.mount: str(self.workspace.files_dir)}

    def export_tree(self, paths: list[str], max_bytes: int) -> bytes:
        """:meth:`sandboxes.base.Sandbox.export_tree`, capped by ``sandbox_export_max_mb`` too."""
        from config.settings import get_settings

        if self.shell is None or self.shell.closed:
            raise SandboxGone("the sandbox is closed")
        cap = min(max_bytes, get_settings().sandbox_export_max_mb << 20)
        bases = self._bases()
        try:
            return export_tar(bases, paths, cap, self.workspace.mount)
        finally:
            _close_fds(bases)

    def finish(self, paths: list[str], max_bytes: int, settle_s: float = 0.0) -> FinishResponse:
        """:meth:`sandboxes.base.Sandbox.finish`: the paths are checked; for ``settle_s`` they are
        watched (one that changes meanwhile was written by something still running:
        ``rewritten``); then the shell is closed (for a runtime whose shell has a pid 1 of its own,
        reaping it proves that everything in the sandbox is dead; ``local`` kills the shell's
        process group and descendants, which a daemon that left both outlives), then the files
        read, then all closed."""
        if self.shell is None or self.shell.closed:
            raise SandboxGone("the sandbox is closed")
        bases = self._bases()
        try:
            for path in paths:
                locate(bases, path, self.workspace.mount)
        except BaseException:
            _close_fds(bases)
            raise
        try:
            rewritten = _settle(bases, paths, self.workspace.mount, settle_s)
            killed_at = time.time_ns()
            self.shell.close()
            mtimes: dict[str, int] = {}
            files = read_files(bases, paths, min(max_bytes, read_cap_bytes()), self.workspace.mount, mtimes)
            return FinishResponse(files=files, mtimes_ns=mtimes, killed_at_ns=killed_at, rewritten=rewritten)
        finally:
            _close_fds(bases)
            self.close()

    def kill(self) -> None:
        """SIGKILL everything at once (a signal per process, no wait); :meth:`close` finishes.
        Only signals: a bulk close kills every sandbox before any teardown, and the workspace's
        detach here (~2 ms of kernel time each, serialised) made the last of 1,000 kills wait
        seconds for the others' (bench/RESULTS.md, bulk cancel)."""
        if self.shell is not None:
            self.shell.kill()

    def close(self) -> None:
        """The shell first (nothing runs any more), then what confines it, the files (moved
        aside, then deleted), and last what the sandbox held (its uid, its image): only once
        nothing uses them."""
        if self.shell is not None:
            self.shell.close()
        self._close_limits()
        self.workspace.retire()
        self.workspace.remove()
        self._release()

    def _close_limits(self) -> None:
        """Tear down what confines the sandbox beyond its shell (a cgroup)."""

    def _release(self) -> None:
        if self._uid is not None:
            self._uid.release()  # only now: nothing of the sandbox runs as that uid any more
            self._uid = None

    def info(self) -> dict[str, Any]:
        shell = self.shell
        return {"runtime": self.name, "isolation": self.isolation,
                "pid": shell.pid if shell else None, "workspace": str(self.workspace.host_dir),
                "workdir": str(self.workdir), "cwd": shell.cwd if shell else None,
                "job_id": self.job_id, "restarts": shell.restarts if shell else 0,
                "limits": self.spec.limits.model_dump(exclude_none=True), **self._info()}

    def _info(self) -> dict[str, Any]:
        """What the runtime adds to :meth:`info`."""
        return {}


def _close_fds(bases: dict[str, str | int]) -> None:
    for base in bases.values():
        if isinstance(base, int):
            os.close(base)
