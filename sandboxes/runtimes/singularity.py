"""``singularity``: a persistent bash in an Apptainer (or SingularityCE) container per sandbox.

The image is a ``.sif`` file, a sandbox directory (a rootfs with the usual mount points), or a
registry reference (``docker://``, ``oras://``, ``library://`` ...), pulled once per node into a
cache with ``apptainer pull``, under a file lock and a time limit. The binary is the runtime's
``binary`` setting, else ``PRORL_APPTAINER_BIN``, else ``apptainer`` or ``singularity`` on PATH
(``scripts/install-apptainer.sh`` installs one where Debian has none).

The sandbox's shell is one container, ``apptainer exec --containall --no-privs --network none
... <image> bash``, and the sandbox is that container: what the shell starts lives in its pid
namespace, whose pid 1 (apptainer's ``appinit``) is killed with the runtime parent we start.
Not an instance: an instance cannot be joined as another uid (``instance start --security
uid:N`` files it under user N, who must exist, and root cannot ``exec`` into it), and commands
run as host uid 0 in an instance started by root, which without capabilities still writes
root-owned files such as ``/proc/sys/vm/*`` (tried here). So, as in :mod:`sandboxes.runtimes.bwrap`:

- a host running as root runs each sandbox as its own uid (``--security uid:N,gid:N``, the
  same leased range and lock directory as bwrap, so the two runtimes never share a uid);
  ``--no-privs`` drops every capability (a system ``apptainer.conf`` may grant root the
  default set); the workspace is the one writable bind, at ``/workspace``; the image is
  read-only, ``/tmp`` a private tmpfs (its size is the apptainer.conf ``sessiondir max size``);
  no network (``spec.network`` is refused: without ``--net`` a container shares the host's);
- the environment is cleared (``--containall`` implies ``--cleanenv``) and the shell itself
  exports the fixed defaults and ``spec.env`` once it runs (:class:`~sandboxes.runtimes.shell.pid1.BwrapShell`,
  whose process tree, runtime parent -> pid 1 -> bash, is this one too): nothing of a request is
  on a host-side command line or environment;
- a timeout kills every process of the container but the shell (descendants of its pid 1);
  close kills its pid 1 (the kernel ends the namespace) and reaps the runtime parent.

Limits (:func:`enforcement` says which hold where): ``memory_mb``, ``cpus`` and ``pids`` by
apptainer's own cgroup (``--memory``, ``--cpus``, ``--pids-limit``) when the host is root, or
with ``cgroups: true`` where rootless cgroups work (cgroup v2 under systemd); otherwise memory is
an address-space rlimit per process, pids an RLIMIT_NPROC of the sandbox's uid (root only), cpus
not at all. ``disk_mb``: the workspace filesystem of :mod:`sandboxes.runtimes.workspace` where the host can
make one, else RLIMIT_FSIZE. The rest are rlimits the shell sets.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field

from prorl_celery.errors import SandboxError
from sandboxes.base import Limits, SandboxSpec
from sandboxes.protocol import Stray
from sandboxes.runtimes.bwrap import SANDBOX_PATH
from sandboxes.runtimes.shell.pid1 import BwrapShell, tree_info
from sandboxes.runtimes.limits.netns import HELPER_ENV
from sandboxes.runtimes.images.sif import docker_pull, pull_image, run_cli
from sandboxes.runtimes.shell.spawn import NONINTERACTIVE_ENV
from sandboxes.runtimes.shellbox import IsolatedConfig, ShellSandbox
from sandboxes.runtimes.workspace import Workspace, quota_supported

PREFIX = "prorl"
_NAME_RE = re.compile(rf"^{PREFIX}\.(?P<job>[A-Za-z0-9_.-]+)\.(?P<ms>\d+)\.(?P<nonce>[0-9a-f]+)$")
_REMOTE = re.compile(r"^(docker|docker-daemon|docker-archive|oci-archive|oras|library|shub|https?)://")
_MB = 1 << 20


class SingularityConfig(IsolatedConfig):
    binary: str | None = Field(None, description="The apptainer/singularity binary; default: "
                               "settings.apptainer_bin, else apptainer or singularity on PATH.")
    image: str | None = Field(None, description="Image when the spec names none (.sif, a "
                              "sandbox directory, or docker://...).")
    cache_dir: str | None = Field(None, description="Where pulled images are kept; default: "
                                                    "<tmp>/prorl-sif-cache.")
    cgroups: bool | None = Field(None, description="Apply memory/cpus/pids through apptainer's "
                                 "cgroup flags; default (None): when the host is root.")
    writable_tmpfs: bool = Field(False, description="A throw-away writable layer over the image "
                                 "(--writable-tmpfs); off: the image is read-only, as bwrap's.")
    extra_options: list[str] = Field([], description="More `exec` options, e.g. --nv.")
    pull_timeout_s: float | None = Field(None, description="Longest image pull; default: "
                                         "settings.sandbox_image_pull_timeout_s.")


# -- the binary -------------------------------------------------------------------------------
def binary(configured: str | None = None) -> str | None:
    """The apptainer binary to run: ``configured``, settings.apptainer_bin, or one on PATH."""
    from config.settings import get_settings

    for candidate in (configured, get_settings().apptainer_bin):
        if candidate:
            found = shutil.which(candidate)
            return found if found else None
    return shutil.which("apptainer") or shutil.which("singularity")


# -- pure: command lines ----------------------------------------------------------------------
def use_cgroups(config: SingularityConfig) -> bool:
    return os.geteuid() == 0 if config.cgroups is None else config.cgroups


def limit_options(limits: Limits, cgroups: bool) -> list[str]:
    """Apptainer's cgroup flags for the limits it enforces (memory without extra swap)."""
    if not cgroups:
        return []
    out: list[str] = []
    if limits.memory_mb:
        out += ["--memory", f"{limits.memory_mb}M", "--memory-swap", f"{limits.memory_mb}M"]
    if limits.cpus:
        out += ["--cpus", f"{limits.cpus:g}"]
    if limits.pids:
        out += ["--pids-limit", str(limits.pids)]
    return out


def shell_rlimits(limits: Limits, cgroups: bool, own_uid: bool, quota: bool) -> Limits:
    """What the shell's ulimit sets, given what the cgroup and the workspace filesystem hold."""
    update: dict[str, Any] = {}
    if cgroups:
        update["memory_mb"] = None
    elif own_uid and limits.pids and not limits.nproc:
        update["nproc"] = limits.pids
    if not quota and limits.disk_mb and not limits.fsize_mb:
        update["fsize_mb"] = limits.disk_mb
    return limits.model_copy(update=update)


def exec_argv(binary_path: str, config: SingularityConfig, *, image: str, workspace_dir: str,
              workdir: str, limits: Limits, uid: int | None) -> list[str]:
    """The whole command line of one sandbox's shell (pure: no I/O)."""
    argv = [binary_path, "--quiet", "exec", "--containall", "--no-privs", "--no-home",
            "--net", "--network", "none", "--hostname", config.hostname,
            "--no-mount", "sys,bind-paths,cwd"]
    argv += ["--security", f"uid:{uid},gid:{uid}"] if uid is not None else []
    argv += ["--writable-tmpfs"] if config.writable_tmpfs else []
    argv += limit_options(limits, use_cgroups(config))
    argv += ["--bind", f"{workspace_dir}:{config.mount}", "--pwd", workdir]
    return argv + list(config.extra_options) + [image, *config.shell]


def inner_env(config: SingularityConfig, spec: SandboxSpec) -> dict[str, str]:
    """What the shell exports before any command: bwrap's fixed defaults, then ``spec.env``."""
    base = {"PATH": SANDBOX_PATH, "HOME": config.mount, "USER": "root", "LOGNAME": "root",
            "LANG": "C.UTF-8", "TMPDIR": "/tmp", "SHELL": "/bin/bash", "HOSTNAME": config.hostname}
    return {**NONINTERACTIVE_ENV, **base, **spec.env}


# -- instances (none are made any more; what an older runtime left is swept) -------------------
def parse_instance_name(name: str) -> tuple[str, float] | None:
    """(job id, start time) of one of our instance names; None for anyone else's instance."""
    match = _NAME_RE.match(name)
    return (match["job"], int(match["ms"]) / 1000) if match else None


def list_instances() -> list[dict[str, Any]]:
    """Our instances on this node: ``{name, job_id, started_at, pid}`` (``instance list``)."""
    found = binary()
    if not found:
        return []
    done = run_cli([found, "--quiet", "instance", "list", "--json"], 60)
    if done.returncode != 0:
        raise SandboxError(f"instance list exited {done.returncode}: {done.stderr[-500:]}")
    out = []
    for item in json.loads(done.stdout or "{}").get("instances") or []:
        parsed = parse_instance_name(item.get("instance", ""))
        if parsed:
            out.append({"name": item["instance"], "job_id": parsed[0], "started_at": parsed[1],
                        "pid": item.get("pid")})
    return out


def stop_instance(name: str) -> None:
    done = run_cli([binary() or "apptainer", "--quiet", "instance", "stop", "--force", name], 60)
    if done.returncode != 0:
        raise SandboxError(f"instance stop {name} exited {done.returncode}: {done.stderr[-500:]}")


def enforcement(config: SingularityConfig | None = None) -> dict[str, str]:
    """Limit name -> how a singularity sandbox's limit is held on this node."""
    config = config or SingularityConfig()
    cg, root = use_cgroups(config), os.geteuid() == 0
    return {
        "memory_mb": "apptainer cgroup (--memory, swap included)" if cg
        else "rlimit RLIMIT_AS per process, not their sum (no cgroups for a non-root host)",
        "cpus": "apptainer cgroup (--cpus)" if cg else "not enforced (no cgroups)",
        "pids": "apptainer cgroup (--pids-limit)" if cg else "rlimit RLIMIT_NPROC of the "
        "sandbox's own uid" if root else "not enforced: sandboxes share the host's uid",
        "disk_mb": "ext4 on a loop device per workspace" if quota_supported()
        else "rlimit RLIMIT_FSIZE per file, not the total",
        "tmp": "apptainer.conf 'sessiondir max size' (all of a container's tmpfs)",
        "network": "none (--network none); network sandboxes are bwrap's",
    }


class SingularitySandbox(ShellSandbox):
    """The :class:`~sandboxes.base.Sandbox` protocol in an Apptainer/Singularity container."""

    name = "singularity"
    isolation = "container"
    config_class = SingularityConfig

    def __init__(self, spec: SandboxSpec, job_id: str, config: SingularityConfig | dict | None = None):
        self.spec, self.job_id = spec, job_id
        self.config = SingularityConfig.model_validate(config or {})
        if spec.writable_root:
            raise SandboxError("writable_root is not supported by the singularity runtime (bwrap "
                               "on a root host gives it)")
        self.binary = binary(self.config.binary)
        uid = self._lease_uid(self.config)
        host_dir = tempfile.mkdtemp(prefix="sif-", dir=self.config.root)
        self.workspace = Workspace(host_dir, self.config.mount, uid, uid)
        try:
            if not self.binary:
                raise SandboxError("no apptainer/singularity binary (set PRORL_APPTAINER_BIN; "
                                   "scripts/install-apptainer.sh installs one)")
            if spec.network:
                raise SandboxError("the singularity runtime has no isolated network (without --net "
                                   "a container shares the host's); use the bwrap runtime for a "
                                   "network sandbox")
            self.image = self._image(spec.image or self.config.image)
            quota = bool(spec.limits.disk_mb) and quota_supported()
            if quota:
                self.workspace.mount_quota(spec.limits.disk_mb)
            if uid is not None:
                os.chown(host_dir, uid, uid)
            self.workdir = self._workdir(spec.workdir)
            argv = exec_argv(self.binary, self.config, image=self.image, workspace_dir=host_dir,
                             workdir=self.workdir, limits=spec.limits, uid=uid)
            rlimits = shell_rlimits(spec.limits, use_cgroups(self.config), uid is not None, quota)
            self.shell = BwrapShell(argv, cwd="/", env=dict(HELPER_ENV, HOME=os.path.expanduser("~")),
                                    limits=rlimits, inner_env=inner_env(self.config, spec))
        except BaseException:
            self.close()
            raise

    @classmethod
    def available(cls, config: dict[str, Any] | None = None) -> bool:
        return binary() is not None

    @classmethod
    def strays(cls, config: dict[str, Any] | None = None) -> list[Stray]:
        """Our instances on this node (``instance list``): they run under Apptainer's starter,
        not under the host, and outlive a host that died."""
        return [Stray(runtime=cls.name, name=item["name"], job_id=item["job_id"],
                      started_at=item["started_at"]) for item in list_instances()]

    @classmethod
    def stop_stray(cls, name: str, config: dict[str, Any] | None = None) -> None:
        stop_instance(name)

    def _image(self, image: str | None) -> str:
        if not image:
            raise SandboxError("the singularity runtime needs an image (spec.image or config.image)")
        if _REMOTE.match(image):
            options, errors = (), None
            if image.startswith("docker://"):
                image, options, errors = docker_pull(image)
            cache = self.config.cache_dir or os.path.join(tempfile.gettempdir(), "prorl-sif-cache")
            from config.settings import get_settings

            timeout = self.config.pull_timeout_s or get_settings().sandbox_image_pull_timeout_s
            return pull_image(self.binary, image, cache, timeout, options, errors)
        if not Path(image).exists():
            raise SandboxError(f"image {image!r} does not exist on this host")
        return image

    def _workdir(self, workdir: str | None) -> str:
        mount = self.config.mount
        inside = workdir if workdir and workdir.startswith("/") else \
            f"{mount}/{workdir}" if workdir else mount
        if inside != mount and inside.startswith(mount + "/"):
            self.workspace.makedirs(inside)
        return inside

    def _info(self) -> dict[str, Any]:
        return {"network": "none", **tree_info(self.shell), "uid": self.workspace.uid,
                "image": self.image, "binary": self.binary, "mount": self.config.mount,
                "cgroups": use_cgroups(self.config)}
