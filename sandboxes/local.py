"""``local``: a persistent shell in a fresh temp directory on the host. NO isolation: dev only."""
from __future__ import annotations

import logging
import os
import resource
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prorl_celery.errors import SandboxError
from sandboxes.base import ExecResult, Limits, SandboxSpec
from sandboxes.shell import DEFAULT_ARGV, PersistentShell

log = logging.getLogger(__name__)
_warned = False

_BASE_ENV_KEYS = ("PATH", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR", "SHELL")
_MB = 1024 * 1024


class LocalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    root: str | None = Field(None, description="Directory under which workspaces are created; "
                                                "default: the system temp directory.")
    shell: list[str] = Field(list(DEFAULT_ARGV), description="argv of the persistent shell.")


def limits_preexec(limits: Limits) -> Callable[[], None] | None:
    """A preexec that applies what ``setrlimit`` can enforce. Best effort: root ignores NPROC,
    ``cpu_s`` also counts the shell's own builtins, ``wall_s`` is enforced by the sandbox host."""
    pairs = [(resource.RLIMIT_AS, limits.memory_mb and limits.memory_mb * _MB),
             (resource.RLIMIT_CPU, limits.cpu_s),
             (resource.RLIMIT_NPROC, limits.nproc),
             (resource.RLIMIT_FSIZE, limits.fsize_mb and limits.fsize_mb * _MB)]
    pairs = [(which, value) for which, value in pairs if value]
    if not pairs:
        return None

    def apply() -> None:
        for which, value in pairs:
            resource.setrlimit(which, (value, value))

    return apply


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("sandbox runtime 'local' has NO isolation: commands run as this user on this "
                    "machine. Use it for development only.")


class LocalSandbox:
    """The :class:`~sandboxes.base.Sandbox` protocol with a temp directory as the only boundary."""

    name = "local"
    config_class = LocalConfig

    def __init__(self, spec: SandboxSpec, job_id: str, config: LocalConfig | dict | None = None):
        _warn_once()
        self.spec = spec
        self.job_id = job_id
        self.config = LocalConfig.model_validate(config or {})
        safe_id = "".join(c if c.isalnum() or c in "-_" else "_" for c in job_id)[:40]
        self.workspace = Path(tempfile.mkdtemp(prefix=f"prorl-{safe_id}-", dir=self.config.root))
        try:
            self.workdir = self._workdir(spec.workdir)
            self.shell = PersistentShell(self.config.shell, cwd=str(self.workdir), env=self._env(),
                                         preexec_fn=limits_preexec(spec.limits))
        except BaseException:
            shutil.rmtree(self.workspace, ignore_errors=True)
            raise

    @classmethod
    def available(cls) -> bool:
        return shutil.which(LocalConfig().shell[0]) is not None

    def _workdir(self, workdir: str | None) -> Path:
        if not workdir:
            return self.workspace
        path = self.resolve(workdir)
        if os.path.isabs(workdir) and not path.is_dir():
            raise SandboxError(f"workdir {workdir!r} does not exist on this host")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _env(self) -> dict[str, str]:
        env = {k: os.environ[k] for k in _BASE_ENV_KEYS if k in os.environ}
        env.setdefault("PATH", os.defpath)
        env["HOME"] = str(self.workspace)
        return {**env, **self.spec.env}

    def resolve(self, path: str) -> Path:
        """Relative paths are relative to the workspace (not the shell's current directory)."""
        return Path(path) if os.path.isabs(path) else self.workspace / path

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        return self.shell.run(command, timeout)

    def interrupt(self) -> None:
        self.shell.interrupt()

    def read_file(self, path: str) -> bytes:
        return self.resolve(path).read_bytes()

    def write_file(self, path: str, data: bytes) -> None:
        target = self.resolve(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    def close(self) -> None:
        self.shell.close()
        shutil.rmtree(self.workspace, ignore_errors=True)

    def info(self) -> dict[str, Any]:
        return {"runtime": self.name, "isolation": "none", "network": "host",
                "pid": self.shell.pid, "workspace": str(self.workspace), "workdir": str(self.workdir),
                "cwd": self.shell.cwd, "job_id": self.job_id, "restarts": self.shell.restarts,
                "limits": "best-effort setrlimit"}
