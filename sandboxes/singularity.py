"""``singularity``: an Apptainer / SingularityCE instance per sandbox, driven through spython.

The image is a ``.sif`` path or a ``docker://`` (``oras://``, ``library://`` ...) reference,
pulled once per node into a cache directory under a file lock. The instance is started with
``--writable-tmpfs --contain --no-home --net --network none`` (plus ``--fakeroot`` when
configured), the workspace bound at ``/workspace``; ``spec.network`` is refused (Apptainer's own
networks need root and CNI setup; without ``--net`` an instance would share the host's network:
a network sandbox is a bwrap one, see :mod:`sandboxes.netns`); its
name carries the job id and start time (``prorl.<job id>.<start ms>.<nonce>``), so a sweep that
only sees ``instance list`` can still tell whose it is and how old. The persistent shell is
``singularity exec --cleanenv instance://<name> bash``, run by our own Popen with a few of the
host's own variables only: ``spec.env`` goes into the container as ``--env`` flags.

spython's traps and what is done about them: it calls ``sys.exit`` on some errors (caught here
as ``SystemExit`` and raised as :class:`SandboxError`, so a worker never exits); its ``environ``
replaces the whole environment (never used: the shell gets ``--env`` flags); ``execute`` has no
timeout (not used: the shell is ours, with timeouts that kill process groups); a failed
``instance start`` only logs (checked: the instance must have a pid); calls are run with a
timeout in a helper thread. spython always runs ``singularity`` (Apptainer ships that name).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from prorl_celery.errors import SandboxError
from sandboxes.base import ExecResult, SandboxSpec
from sandboxes.shell import DEFAULT_ARGV, PersistentShell
from sandboxes.workspace import Workspace, WorkspaceFiles

T = TypeVar("T")
PREFIX = "prorl"
_NAME_RE = re.compile(rf"^{PREFIX}\.(?P<job>[A-Za-z0-9_.-]+)\.(?P<ms>\d+)\.(?P<nonce>[0-9a-f]+)$")
_REMOTE = re.compile(r"^(docker|docker-daemon|oras|library|shub|https?)://")
_HOST_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "APPTAINER_CACHEDIR",
             "SINGULARITY_CACHEDIR")


class SingularityConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image: str | None = Field(None, description="Image when the spec names none (.sif or docker://...).")
    cache_dir: str | None = Field(None, description="Where pulled images are kept; default: "
                                                    "<tmp>/prorl-sif-cache.")
    root: str | None = Field(None, description="Host directory under which workspaces are made.")
    mount: str = Field("/workspace", description="Where the workspace appears in the instance.")
    fakeroot: bool = Field(False, description="Start instances with --fakeroot (root inside).")
    extra_options: list[str] = Field([], description="More `instance start` options, e.g. --nv.")
    pull_timeout_s: float = Field(1800.0, description="Longest image pull.")
    start_timeout_s: float = Field(300.0, description="Longest `instance start`.")
    shell: list[str] = Field(list(DEFAULT_ARGV), description="argv of the persistent shell.")


# -- pure: names and command lines --------------------------------------------------------------
def instance_name(job_id: str, started_at: float, nonce: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:96]
    return f"{PREFIX}.{safe}.{int(started_at * 1000)}.{nonce}"


def parse_instance_name(name: str) -> tuple[str, float] | None:
    """(job id, start time) of one of our instance names; None for anyone else's instance."""
    match = _NAME_RE.match(name)
    return (match["job"], int(match["ms"]) / 1000) if match else None


def start_options(config: SingularityConfig, spec: SandboxSpec, workspace_dir: str) -> list[str]:
    options = ["--writable-tmpfs", "--contain", "--no-home", "--cleanenv"]
    options += ["--fakeroot"] if config.fakeroot else []
    options += [] if spec.network else ["--net", "--network", "none"]
    options += ["--bind", f"{workspace_dir}:{config.mount}"]
    return options + list(config.extra_options)


def start_argv(image: str, name: str, options: list[str]) -> list[str]:
    """What spython's ``Instance.start`` runs for us (a quiet instance, so ``--quiet``)."""
    return ["singularity", "--quiet", "instance", "start", *options, image, name]


def shell_argv(binary: str, name: str, env: dict[str, str], workdir: str,
               shell: list[str]) -> list[str]:
    flags = [x for key, value in sorted(env.items()) for x in ("--env", f"{key}={value}")]
    return [binary, "exec", "--cleanenv", *flags, "--pwd", workdir, f"instance://{name}", *shell]


def cached_image_path(cache_dir: str, ref: str) -> str:
    digest = hashlib.sha256(ref.encode()).hexdigest()[:24]
    return os.path.join(cache_dir, f"{digest}.sif")


# -- spython, made safe ---------------------------------------------------------------------
_calls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="spython")


def spython_call(fn: Callable[..., T], *args: Any, timeout: float = 120.0, **kwargs: Any) -> T:
    """Run a spython call with a timeout; its ``sys.exit`` and errors become SandboxError."""
    def guarded() -> T:
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            raise SandboxError(f"spython gave up ({getattr(fn, '__name__', fn)}): exit {exc.code}") from None

    try:
        return _calls.submit(guarded).result(timeout=timeout)
    except FutureTimeout:
        raise SandboxError(f"spython call {getattr(fn, '__name__', fn)} took over {timeout:.0f}s") from None
    except SandboxError:
        raise
    except Exception as exc:  # noqa: BLE001 - spython raises anything
        raise SandboxError(f"spython {getattr(fn, '__name__', fn)} failed: {exc}") from exc


def client():
    from spython.main import Client

    Client.quiet = True
    return Client


def binary() -> str | None:
    return shutil.which("apptainer") or shutil.which("singularity")


def list_instances() -> list[dict[str, Any]]:
    """Our instances on this node: ``{name, job_id, started_at, pid}`` (apptainer instance list)."""
    if not shutil.which("singularity"):
        return []
    raw = spython_call(client().instances, quiet=True, return_json=True)
    out = []
    for item in raw if isinstance(raw, list) else [raw]:
        name = item.get("instance") or item.get("daemon_name") or ""
        parsed = parse_instance_name(name)
        if parsed:
            out.append({"name": name, "job_id": parsed[0], "started_at": parsed[1],
                        "pid": item.get("pid")})
    return out


def stop_instance(name: str) -> None:
    code = spython_call(new_instance(f"instance://{name}", name).stop, timeout=60, quiet=True)
    if code:
        raise SandboxError(f"instance stop {name} exited {code}")


def new_instance(image: str, name: str):
    """A spython Instance object (with its commands, as the Client makes them), not started."""
    return client().instance(image, start=False, name=name, quiet=True)


def start_instance(instance, options: list[str], timeout: float) -> None:
    """``instance start`` through spython; a start that only logged its failure raises here."""
    spython_call(instance.start, options=options, quiet=True, timeout=timeout)
    if not getattr(instance, "pid", None):
        raise SandboxError(f"instance {instance.name} did not start: {' '.join(instance.cmd)}")


def pull_image(ref: str, cache_dir: str, timeout: float) -> str:
    """The local .sif of ``ref``, pulled once: concurrent sandboxes wait on the same lock."""
    os.makedirs(cache_dir, exist_ok=True)
    final = cached_image_path(cache_dir, ref)
    with open(final + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(final):
            partial = f"{final}.{os.getpid()}.part"
            spython_call(client().pull, ref, name=partial, timeout=timeout, quiet=True)
            if not os.path.exists(partial):
                raise SandboxError(f"pulling {ref} produced no image")
            os.replace(partial, final)
    return final


class SingularitySandbox(WorkspaceFiles):
    """The :class:`~sandboxes.base.Sandbox` protocol in an Apptainer/Singularity instance."""

    name = "singularity"
    config_class = SingularityConfig

    def __init__(self, spec: SandboxSpec, job_id: str, config: SingularityConfig | dict | None = None):
        self.spec, self.job_id = spec, job_id
        self.config = SingularityConfig.model_validate(config or {})
        self.shell: PersistentShell | None = None
        self.instance = None
        host_dir = tempfile.mkdtemp(prefix="sif-", dir=self.config.root)
        self.workspace = Workspace(host_dir, self.config.mount)
        try:
            if spec.network:
                raise SandboxError("the singularity runtime has no isolated network (without --net "
                                   "an instance shares the host's); use the bwrap runtime for a "
                                   "network sandbox")
            self.image = self._image(spec.image or self.config.image)
            self.started_at = time.time()
            self.instance_name = instance_name(job_id, self.started_at, secrets.token_hex(3))
            self.instance = new_instance(self.image, self.instance_name)
            start_instance(self.instance, start_options(self.config, spec, host_dir),
                           self.config.start_timeout_s)
            workdir = spec.workdir or self.config.mount
            if not workdir.startswith("/"):
                workdir = f"{self.config.mount}/{workdir}"
                self.workspace.makedirs(workdir)
            env = {"HOME": self.config.mount, "TMPDIR": "/tmp", **spec.env}
            host_env = {k: os.environ[k] for k in _HOST_ENV if k in os.environ}
            self.shell = PersistentShell(shell_argv(binary() or "singularity", self.instance_name, env,
                                                    workdir, self.config.shell),
                                         cwd=host_dir, env=host_env, limits=spec.limits)
        except BaseException:
            self.close()
            raise

    @classmethod
    def available(cls) -> bool:
        return shutil.which("singularity") is not None  # spython runs this name

    def _image(self, image: str | None) -> str:
        if not image:
            raise SandboxError("the singularity runtime needs an image (spec.image or config.image)")
        if _REMOTE.match(image):
            cache = self.config.cache_dir or os.path.join(tempfile.gettempdir(), "prorl-sif-cache")
            return pull_image(image, cache, self.config.pull_timeout_s)
        if not Path(image).exists():
            raise SandboxError(f"image {image!r} does not exist on this host")
        return image

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        return self.shell.run(command, timeout)

    def interrupt(self) -> None:
        self.shell.interrupt()

    def close(self) -> None:
        if self.shell is not None:
            self.shell.close()
        if self.instance is not None:
            try:
                stop_instance(self.instance_name)
            except SandboxError:
                pid = getattr(self.instance, "pid", None)
                if pid:
                    try:
                        os.kill(int(pid), 9)
                    except (ProcessLookupError, ValueError):
                        pass
            self.instance = None
        self.workspace.remove()

    def info(self) -> dict[str, Any]:
        return {"runtime": self.name, "isolation": "container",
                "network": "host" if self.spec.network else "none",
                "pid": self.shell.pid if self.shell else None, "instance": self.instance_name,
                "instance_pid": getattr(self.instance, "pid", None), "image": self.image,
                "workspace": str(self.workspace.host_dir), "mount": self.config.mount,
                "cwd": self.shell.cwd if self.shell else None, "job_id": self.job_id,
                "limits": self.spec.limits.model_dump(exclude_none=True)}
