"""``local``: a persistent shell in a fresh temp directory on the host. NO isolation: dev only.

The shell is the host-side process here, so ``spec.env`` is its environment: what keeps a request
from steering it is :class:`~sandboxes.base.SandboxSpec`'s refusal of ``LD_*``, ``BASH_ENV`` and the
like, and the shell's own binary being found on the host's PATH, never on the spec's. ``"network":
true`` is refused when the operator turned network sandboxes off (the host's network is all this
runtime has). ``finish`` kills the shell's process group and its descendants before it reads:
weaker than a pid namespace's end, a daemon that left both (``setsid`` and a double fork) may
still be writing.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from config.settings import get_settings
from prorl_celery.errors import SandboxError
from sandboxes.base import SandboxSpec
from sandboxes.runtimes.limits.netns import require_network
from sandboxes.runtimes.shell.persistent import PersistentShell
from sandboxes.runtimes.shellbox import ShellConfig, ShellSandbox
from sandboxes.runtimes.shell.spawn import shell_warm_spec
from sandboxes.runtimes.workspace import Workspace, remove_tree

log = logging.getLogger(__name__)
_warned = False

_BASE_ENV_KEYS = ("PATH", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR", "SHELL")


class LocalConfig(ShellConfig):
    """``root`` and ``shell`` only: the workspace is the shell's own directory on the host."""


@functools.lru_cache(maxsize=8)
def _which(name: str, path: str) -> str | None:
    """:func:`shutil.which`, once per name and PATH (a walk of the PATH costs ~0.2 ms a create)."""
    return shutil.which(name, path=path)


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("sandbox runtime 'local' has NO isolation: commands run as this user on this "
                    "machine. Use it for development only.")


class LocalSandbox(ShellSandbox):
    """The :class:`~sandboxes.base.Sandbox` protocol with a temp directory as the only boundary.

    Limits are best effort: ``ulimit`` in the shell, which root's processes ignore for nproc;
    ``wall_s`` is enforced by the sandbox host. File paths stay inside the workspace."""

    name = "local"
    isolation = "none"
    config_class = LocalConfig

    def __init__(self, spec: SandboxSpec, job_id: str, config: LocalConfig | dict | None = None):
        if spec.writable_root:
            raise SandboxError("writable_root is not supported by the local runtime (it has no "
                               "image root; bwrap on a root host gives it)")
        _warn_once()
        self.spec = spec
        self.job_id = job_id
        self.config = LocalConfig.model_validate(config or {})
        safe_id = "".join(c if c.isalnum() or c in "-_" else "_" for c in job_id)[:40]
        host_dir = Path(tempfile.mkdtemp(prefix=f"prorl-{safe_id}-", dir=self.config.root))
        self.workspace = Workspace(host_dir, str(host_dir))
        try:
            self.workdir = self._workdir(spec.workdir)
            if spec.network and get_settings().sandbox_network == "off":
                require_network()
            self.shell = PersistentShell(self._argv(), cwd=str(self.workdir), env=self._env(),
                                         limits=spec.limits)
        except BaseException:
            remove_tree(host_dir)
            raise

    auto_rank = 1  # 'auto' falls back to it (no isolation) only where the operator allows 'local'

    @classmethod
    def available(cls, config: dict[str, Any] | None = None) -> bool:
        shell = (config or {}).get("shell") or LocalConfig().shell
        return shutil.which(shell[0]) is not None

    @property
    def host_dir(self) -> Path:
        return self.workspace.host_dir

    def _workdir(self, workdir: str | None) -> Path:
        if not workdir:
            return self.host_dir
        path = Path(workdir) if os.path.isabs(workdir) else self.host_dir / workdir
        if os.path.isabs(workdir) and not path.is_dir():
            raise SandboxError(f"workdir {workdir!r} does not exist on this host")
        if not os.path.isabs(workdir):
            self.workspace.makedirs(workdir)
        return path

    def _argv(self) -> list[str]:
        """The shell by absolute path: Popen would otherwise look it up on the spec's PATH."""
        binary = _which(self.config.shell[0], os.environ.get("PATH", os.defpath))
        if binary is None:
            raise SandboxError(f"shell {self.config.shell[0]!r} not found on this host")
        return [binary, *self.config.shell[1:]]

    def _env(self) -> dict[str, str]:
        env = {k: os.environ[k] for k in _BASE_ENV_KEYS if k in os.environ}
        env.setdefault("PATH", os.defpath)
        env["HOME"] = str(self.host_dir)
        return {**env, **self.spec.env}

    @classmethod
    def warm_spec(cls, spec: SandboxSpec) -> SandboxSpec | None:
        """What must be fixed at start (see :mod:`sandboxes.host.warm`); the rest is claimed."""
        return shell_warm_spec(spec)

    def _info(self) -> dict[str, Any]:
        return {"network": "host"}
