"""``bwrap``: a persistent bash inside bubblewrap namespaces. Rootless; the default runtime.

What the sandbox gets: new user, pid, ipc, uts, cgroup and network namespaces (with
``spec.network``, its own network behind user-mode networking: :mod:`sandboxes.runtimes.limits.netns`; never the
host's); no capabilities and no nested user namespaces; a read-only root (the host's system
directories, or an image rootfs directory: :mod:`sandboxes.runtimes.rootfs`), or with
``spec.writable_root`` the image's root writable through an overlay of the sandbox's own
(:mod:`sandboxes.runtimes.writable`, with ``/logs`` the host reads once it is dead); the node's
gateway sockets and harnesses read-only; its workspace read-write at ``/workspace``; a private
size-capped ``/tmp`` and ``/dev/shm``; a fresh ``/proc`` and a minimal ``/dev``; a cleared
environment (``--clearenv``, fixed defaults by ``--setenv``, ``spec.env`` exported by the shell
itself once it runs: a request's variables never reach the host-side ``setpriv``/``bwrap``, which
start with :data:`HOST_ENV` only, nor their command lines); rlimits set on its shell. A host running as root starts each sandbox as its own
unprivileged uid (see :mod:`sandboxes.runtimes.limits.uids`), so ``nproc`` holds and nothing runs as host root.

Processes: ``bwrap`` (started by the host, dies with it) -> ``bwrap`` as pid 1 of the sandbox ->
``bash``. Killing that pid 1 makes the kernel kill everything in the sandbox.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field

from prorl_celery.errors import SandboxError, SandboxGone
from sandboxes.base import Limits, SandboxSpec
from sandboxes.images import is_reference
from sandboxes.runtimes.images.cache import ImageLease, open_image
from sandboxes.runtimes.limits import exitboost, idmap
from sandboxes.runtimes.limits.cgroups import SandboxLimits, warm_limits
from sandboxes.runtimes.limits.netns import HELPER_ENV, require_network, resolv_conf, tool
from sandboxes.runtimes.rootfs import HOST_PATHS, has_resolv, image_env, image_meta, node_binds, root_entries
from sandboxes.runtimes.shell.pid1 import BwrapShell, tree_info
from sandboxes.runtimes.shell.spawn import NONINTERACTIVE_ENV, TRUSTED_BASH, shell_warm_spec, trusted_argv
from sandboxes.runtimes.shellbox import IsolatedConfig, ShellSandbox
from sandboxes.runtimes.workspace import Workspace
from sandboxes.protocol import LayerEntry
from sandboxes.runtimes import layers
from sandboxes.runtimes.layers import LayerHold
from sandboxes.runtimes.writable import LOGS_MOUNT, WORKSPACE, WritableRoot

SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_MB = 1024 * 1024
SETPRIV = shutil.which("setpriv")
HOST_ENV = HELPER_ENV  # the host-side start's whole environment: nothing from a request


class BwrapConfig(IsolatedConfig):
    bwrap: str = Field("bwrap", description="The bubblewrap binary.")
    host_paths: list[str] = Field(list(HOST_PATHS), description="Host paths bound read-only "
                                  "when the spec names no image (missing ones are skipped, "
                                  "symlinks such as /bin -> usr/bin stay symlinks).")
    ro_binds: dict[str, str] = Field({}, description="More read-only binds, host path -> "
                                     "sandbox path (datasets, package caches).")
    tmp_size_mb: int = Field(512, description="Size cap of the private /tmp (and /dev/shm).")


def bwrap_argv(config: BwrapConfig, *, workspace_dir: str, workdir: str, network: bool,
               root: list[tuple[str, str | None]], image: str | None = None,
               uid: int | None = None, env: dict[str, str] | None = None,
               resolv: str | None = None, overlay: str | None = None,
               logs: str | None = None) -> list[str]:
    """The whole command line of one sandbox's shell. The network namespace is
    always new; with ``network`` the host attaches user-mode networking to it once it runs, and
    ``resolv`` (a file naming that network's resolver) is bound over /etc/resolv.conf. ``env``:
    the whole environment inside (fixed defaults: it is visible in the host's process list).
    ``overlay``: a writable root (a directory bound at ``/`` and left writable) in place of
    ``root``'s read-only entries; ``logs``: a directory bound read-write at ``/logs``."""
    prefix = [SETPRIV or "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] \
        if uid is not None else []
    argv = [tool(config.bwrap) or config.bwrap, "--unshare-all", "--unshare-user", "--disable-userns"]
    argv += ["--uid", "0", "--gid", "0", "--hostname", config.hostname, "--die-with-parent",
             "--new-session", "--cap-drop", "ALL", "--clearenv"]
    for name, value in (env or {}).items():
        argv += ["--setenv", name, value]
    if overlay:
        argv += ["--bind", overlay, "/"]
    for inside, target in root:
        source = os.path.join(image, inside.lstrip("/")) if image else inside
        argv += ["--symlink", target, inside] if target is not None else ["--ro-bind", source, inside]
    if network and resolv:  # the sandbox's network has its own resolver
        argv += ["--ro-bind", resolv, "/etc/resolv.conf"]
    for source, inside in config.ro_binds.items():
        argv += ["--ro-bind", source, inside]
    argv += node_binds(image, overlay is not None, config.host_paths)
    size = str(config.tmp_size_mb * _MB)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev", "--size", size, "--tmpfs", "/tmp",
             "--bind", workspace_dir, config.mount]
    argv += ["--bind", logs, LOGS_MOUNT] if logs else []
    argv += [] if overlay else ["--remount-ro", "/"]
    return prefix + argv + ["--chdir", workdir] + list(config.shell)


@functools.cache
def check_traversable(path: str) -> None:
    """A sandbox's own uid must be able to reach its workspace through the directories above."""
    current = Path(path).resolve()
    for directory in (current, *current.parents):
        if not os.stat(directory).st_mode & 0o001:
            raise SandboxError(f"sandbox workspaces under {path!r} are unreachable for the "
                               f"sandbox uids: {directory} lacks o+x (chmod o+x it, or set "
                               f"the runtime's 'root' elsewhere)")


@functools.cache
def bwrap_works(binary: str = "bwrap") -> bool:
    """Whether unprivileged namespaces work here (a kernel or policy may forbid them)."""
    if not shutil.which(binary) or (os.geteuid() == 0 and not SETPRIV):
        return False
    config = BwrapConfig(bwrap=binary, shell=["true"])
    with tempfile.TemporaryDirectory() as tmp:
        uid = 65534 if os.geteuid() == 0 else None
        os.chmod(tmp, 0o777)
        argv = bwrap_argv(config, workspace_dir=tmp, workdir="/", network=False,
                          root=root_entries(None, config.host_paths), uid=uid)
        try:
            return subprocess.run(argv, capture_output=True, timeout=30, cwd="/").returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


class BwrapSandbox(ShellSandbox):
    """The :class:`~sandboxes.base.Sandbox` protocol in bubblewrap namespaces."""

    name = "bwrap"
    isolation = "namespaces"
    config_class = BwrapConfig

    def __init__(self, spec: SandboxSpec, job_id: str, config: BwrapConfig | dict | None = None):
        self.spec = spec
        self.job_id = job_id
        self.config = BwrapConfig.model_validate(config or {})
        if spec.writable_root and idmap.why_not():
            raise SandboxError(f"writable_root is refused on this host: {idmap.why_not()}")
        # a docker:// / oci: image: its cached rootfs, held until close (never evicted meanwhile)
        self._image: ImageLease | None = open_image(spec.image) if is_reference(spec.image) else None
        self._rootfs = rootfs = self._image.rootfs if self._image else spec.image
        self._root: WritableRoot | None = None
        self._layers: LayerHold | None = None
        uid = self._lease_uid(self.config)
        self._limits: SandboxLimits | None = None
        if uid is not None:
            check_traversable(self.config.root or tempfile.gettempdir())
            if rootfs:
                check_traversable(rootfs)
        host_dir = tempfile.mkdtemp(prefix="bwrap-", dir=self.config.root)
        self.workspace = Workspace(host_dir, self.config.mount, uid, uid,
                                   files=WORKSPACE if spec.writable_root else None)
        try:
            self._limits = SandboxLimits(self.workspace, spec.limits, self.config.root, uid is not None)
            if uid is not None:
                os.chown(host_dir, uid, uid)
            if spec.writable_root:
                self._layers = layers.hold(spec.layers) if spec.layers else None
                self._root = self._writable_root(Path(host_dir), rootfs, uid)
            self.workdir = self._workdir(spec.workdir)
            if spec.network:
                require_network()
            self.shell = BwrapShell(self._argv(uid), cwd="/", env=HOST_ENV,
                                    limits=self._limits.rlimits(spec.limits), guarded=False,
                                    inner_env=spec.env, network=spec.network, low_ports=self._root is not None,
                                    pass_fds=(self._root.fd,) if self._root else ())
            self.shell.cgroup_kill = self._limits.kill_except
        except BaseException:
            self.close()
            raise

    def _writable_root(self, box: Path, rootfs: str, uid: int | None) -> WritableRoot:
        if uid is None or not os.path.isdir(rootfs):
            raise SandboxError(f"writable_root needs a rootfs directory and a sandbox uid "
                               f"(image {self.spec.image!r})")
        return WritableRoot(box, rootfs, uid, self._layers.paths if self._layers else None)

    def freeze(self, layer: str, group_id: str | None = None, job_id: str | None = None,
               timeout: float = 600.0) -> LayerEntry:
        """:meth:`sandboxes.base.SandboxRuntime.freeze`: the shell closed (reaping the sandbox's
        pid 1 proves every process of it dead), the root's changes frozen, the sandbox closed."""
        if self._root is None:
            raise SandboxError("only a writable_root sandbox has a root to freeze")
        if self.shell is None or self.shell.closed:
            raise SandboxGone("the sandbox is closed")
        try:
            self.shell.close()
            return self._root.freeze(layer, group_id, job_id, timeout)
        finally:
            self.close()

    def _argv(self, uid: int | None) -> list[str]:
        """The shell's whole start: cgroup and workspace shims, the overlay's bind, bwrap."""
        rootfs, spec, root = self._rootfs, self.spec, self._root
        resolv = spec.network and (root is not None or has_resolv(rootfs))
        argv = bwrap_argv(self._shell_config(rootfs), workspace_dir=str(self.workspace.files_dir),
                          workdir=self.workdir, network=spec.network,
                          root=[] if root else root_entries(rootfs, self.config.host_paths),
                          image=rootfs, uid=uid, env=self._env(), resolv=resolv_conf() if resolv else None,
                          overlay=root.mountpoint if root else None, logs=root.logs_dir if root else None)
        return self._limits.argv(root.argv(argv) if root else argv)

    auto_rank = 2  # 'auto' prefers bubblewrap's namespaces wherever they work

    @classmethod
    def available(cls, config: dict[str, Any] | None = None) -> bool:
        return bwrap_works((config or {}).get("bwrap") or "bwrap")

    def _shell_config(self, rootfs: str | None) -> BwrapConfig:
        """The config with the execute-only bash as the shell where the sandbox sees the host's
        /usr (a sandbox's parent bash is then not dumpable: see :mod:`sandboxes.runtimes.shell.spawn`)."""
        top = "/" + TRUSTED_BASH.split("/")[1]
        if rootfs or top not in self.config.host_paths:
            return self.config
        return self.config.model_copy(update={"shell": trusted_argv(self.config.shell)})

    def _workdir(self, workdir: str | None) -> str:
        mount = self.config.mount
        if not workdir:
            return mount
        inside = workdir if workdir.startswith("/") else f"{mount}/{workdir}"
        if inside == mount or inside.startswith(mount + "/"):
            self.workspace.makedirs(inside)
        elif self._root is not None:  # bwrap cannot start in a directory the root lacks
            self._root.makedirs(inside)
        return inside

    def _env(self) -> dict[str, str]:
        """The fixed environment inside (``spec.env`` is exported over it once the shell runs)."""
        base = {"PATH": SANDBOX_PATH, "HOME": self.config.mount, "USER": "root", "LOGNAME": "root",
                "LANG": "C.UTF-8", "TMPDIR": "/tmp", "SHELL": "/bin/bash",
                "HOSTNAME": self.config.hostname}
        own = self._image.env if self._image else image_meta(self._rootfs).env
        return {**NONINTERACTIVE_ENV, **base, **image_env(own)}

    @classmethod
    def warm_spec(cls, spec: SandboxSpec) -> SandboxSpec | None:
        """What must be fixed at start (see :mod:`sandboxes.host.warm`); the rest is claimed."""
        warm = shell_warm_spec(spec)
        return warm and warm.model_copy(update={"limits": warm_limits(spec.limits)})

    def _claim_limits(self, limits: Limits) -> Limits:
        self._limits.claim(limits)
        return self._limits.rlimits(limits)

    def hasten_exit(self) -> None:
        """Its cgroup's weight (:mod:`sandboxes.runtimes.limits.exitboost`), until the outer bwrap
        (which exits after everything in the sandbox) is gone."""
        cgroup = self._limits.cgroup if self._limits is not None else None
        pidfd = self.shell.exit_fd() if cgroup is not None and self.shell is not None else None
        if pidfd is not None:
            exitboost.hasten(cgroup.dirs["cpu"], pidfd)

    def usage(self) -> dict[str, Any] | None:
        """Its cgroup's CPU-seconds and peak memory (None on a node where it has no cgroup)."""
        return self._limits.usage() if self._limits is not None else None

    def netns_fd(self) -> int | None:
        return self.shell.namespace("net") if self.shell is not None else None

    def _close_limits(self) -> None:
        if self._limits is not None:
            self._limits.close()  # whatever is still in the cgroup dies here
        if self._root is not None:
            self._root.close()  # nothing of the sandbox runs: its overlay goes with this descriptor

    def _bases(self) -> dict[str, str | int]:
        """The workspace, and a writable root's ``/logs`` and root (a descriptor of its own)."""
        bases = super()._bases()
        if self._root is not None:
            bases.update(self._root.bases(self.workspace.host_dir))
        return bases

    def _release(self) -> None:
        super()._release()
        if self._layers is not None:
            self._layers.release()  # its overlay is gone: the layers may be removed
        if self._image is not None:
            self._image.release()  # nothing runs in its rootfs any more: it may be evicted

    def _info(self) -> dict[str, Any]:
        shell = self.shell
        return {"network": "isolated (slirp4netns)" if self.spec.network else "none",
                "net_pid": shell.net.pid if shell.net else None, **tree_info(shell),
                "uid": self.workspace.uid, "mount": self.config.mount, "image": self.spec.image,
                "writable_root": self._root is not None, "layers": list(self.spec.layers),
                **(self._image.info() if self._image else {})}
