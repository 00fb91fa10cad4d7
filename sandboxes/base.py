"""The sandbox interface: where an agent's commands run.

A runtime (``local``, ``bwrap``, ``singularity``) implements :class:`Sandbox`; a sandbox host
serves sandboxes of any runtime over HTTP, and :class:`sandboxes.client.RemoteSandbox` drives one
from any node by its :class:`SandboxHandle`.
"""
from __future__ import annotations

import os
import re
from typing import IO, TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

if TYPE_CHECKING:
    from sandboxes.protocol import FinishResponse, LayerEntry, StatResult, Stray


class Limits(BaseModel):
    """Per-sandbox resource limits. The defaults are safe on their own (a spec that names no
    limits cannot start thousands of processes, hold gigabytes or fill the host's disk); a
    request may lower them. How each is enforced on a node: :func:`sandboxes.runtimes.limits.cgroups.enforcement`.
    """

    model_config = ConfigDict(extra="forbid")

    memory_mb: int | None = Field(2048, description="Memory of the whole sandbox, MiB: all its "
                                  "processes and the tmpfs pages they write (/tmp, workspace); a "
                                  "memory cgroup where the node has one, else an address-space "
                                  "limit per process.")
    cpu_s: int | None = Field(None, description="CPU time limit per process, seconds.")
    cpus: float | None = Field(1.0, description="CPU bandwidth of the whole sandbox, in cores "
                               "(a cgroup CFS quota).")
    pids: int | None = Field(512, description="Processes and threads of the whole sandbox at "
                             "once (a pids cgroup; else RLIMIT_NPROC of the sandbox's own uid).")
    nproc: int | None = Field(None, description="RLIMIT_NPROC: processes of the sandbox's uid.")
    nofile: int | None = Field(4096, description="Open files per process (RLIMIT_NOFILE).")
    disk_mb: int | None = Field(2048, description="Size of the workspace filesystem, MiB (an "
                                "ext4 image of its own where the host is root; else each file "
                                "is capped at this size by RLIMIT_FSIZE).")
    fsize_mb: int | None = Field(None, description="Largest file a process may write, MiB.")
    wall_s: float | None = Field(None, description="Wall time after which the whole sandbox is killed.")


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Names that make a shell or the dynamic loader run code or change how commands parse: never
# from a request, although sandbox.env only ever reaches the shell inside the sandbox.
REFUSED_ENV = frozenset({
    "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "PROMPT_COMMAND", "IFS", "CDPATH",
    "GLOBIGNORE", "EXECIGNORE", "BASH_XTRACEFD", "BASH_LOADABLES_PATH", "POSIXLY_CORRECT",
    "TMOUT", "INPUTRC", "HISTFILE", "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES",
    "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF",
    "RES_OPTIONS", "TZDIR"})
REFUSED_ENV_PREFIXES = ("LD_", "DYLD_", "BASH_FUNC_")
# PATH entries a request may not put first: places a sandbox (or a local user) can write to.
WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev", "/proc", "/run", "/workspace", "/home")
MAX_ENV_ENTRIES, MAX_ENV_VALUE = 256, 32768
LAYER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{7,95}$")  # a frozen layer's (sandboxes/runtimes/layers.py)


def _env_problem(name: str, value: str) -> str | None:
    """Why ``name=value`` may not be in a sandbox's environment (None: it may)."""
    if not ENV_NAME.match(name):
        return f"{name!r} is not a shell variable name (letters, digits, '_'; at most 128)"
    if name in REFUSED_ENV or name.startswith(REFUSED_ENV_PREFIXES):
        return f"{name} is refused: it makes the shell or the loader run code"
    if "\x00" in value or len(value) > MAX_ENV_VALUE:
        return f"the value of {name} has a NUL byte or is over {MAX_ENV_VALUE} characters"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"the value of {name} is not valid UTF-8"
    if name == "PATH":
        for entry in value.split(":"):
            norm = os.path.normpath(entry) if entry else ""
            if not entry.startswith("/") or norm != entry.rstrip("/") and entry != "/" \
                    or any(norm == top or norm.startswith(top + "/") for top in WRITABLE_DIRS):
                return (f"PATH entry {entry!r} refused: give absolute, normalised directories "
                        f"outside {', '.join(WRITABLE_DIRS)}")
    return None


class SandboxSpec(BaseModel):
    """What an instance's ``sandbox`` block may ask for; the runtime picks what it understands."""

    model_config = ConfigDict(extra="forbid")

    runtime: str | None = Field(None, description="Runtime name or dotted path; default from settings.")
    image: str | None = Field(None, description="Image: rootfs directory (bwrap) or .sif / docker:// (singularity).")
    writable_root: bool = Field(False, description="The image's root, writable through an overlay "
                                "whose changes are the sandbox's own (the image never changes; "
                                "another sandbox of it sees none of them); needs `image`. bwrap on a "
                                "root host only (sandboxes/runtimes/limits/idmap.py); refused elsewhere.")
    layers: list[str] = Field(default_factory=list, max_length=4, description="Frozen layers "
                              "(sandboxes/runtimes/layers.py: a prepared sandbox's changes, by name) "
                              "stacked read-only above the image, topmost first; needs `writable_root`. "
                              "The sandbox's writes stay its own; a layer never changes.")
    limits: Limits = Field(default_factory=Limits, description="Resource limits.")
    network: bool = Field(False, description="Allow network access from inside the sandbox.")
    workdir: str | None = Field(None, description="Directory the shell starts in (inside the sandbox).")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the "
                                "shell inside the sandbox (never for the host-side start). Refused: "
                                "names that are not shell names, LD_*, BASH_ENV, BASH_FUNC_* and "
                                "the like (REFUSED_ENV), NUL bytes, a PATH with relative or "
                                "writable directories.")

    @field_validator("writable_root")
    @classmethod
    def _root_needs_image(cls, writable: bool, info: ValidationInfo) -> bool:
        if writable and not info.data.get("image"):
            raise ValueError("writable_root needs an image (the root it makes writable)")
        return writable

    @field_validator("layers")
    @classmethod
    def _layers_need_writable_root(cls, layers: list[str], info: ValidationInfo) -> list[str]:
        if layers and not info.data.get("writable_root"):
            raise ValueError("layers need writable_root (they lie beneath its overlay)")
        bad = [name for name in layers if not LAYER_NAME.match(name)]
        if bad:
            raise ValueError(f"not layer names: {bad} ({LAYER_NAME.pattern})")
        return layers

    @field_validator("env")
    @classmethod
    def _env_is_safe(cls, env: dict[str, str]) -> dict[str, str]:
        if len(env) > MAX_ENV_ENTRIES:
            raise ValueError(f"at most {MAX_ENV_ENTRIES} variables")
        problems = [why for name, value in env.items() if (why := _env_problem(name, value))]
        if problems:
            raise ValueError("; ".join(problems))
        return env


class ExecResult(BaseModel):
    output: str = Field(description="stdout and stderr, interleaved; cut in the middle when too long.")
    exit_code: int | None = Field(description="Exit status; None when the command was killed.")
    timed_out: bool = False
    interrupted: bool = False
    truncated: bool = False
    duration_s: float = 0.0


class SandboxHandle(BaseModel):
    """Everything a stage on any node needs to drive a sandbox; stored in the job record."""

    host_id: str
    address: str = Field(description="Base URL of the sandbox host, e.g. http://10.0.0.5:8710")
    token: str
    sandbox_id: str
    runtime: str


@runtime_checkable
class Sandbox(Protocol):
    """A live sandbox with one persistent shell.

    A runtime class also has the optional hooks of :class:`SandboxRuntime` (``available``,
    ``auto_rank``, ``warm_spec``, ``claim``, ``open_file``, ``kill``, ``strays``, ``isolation``),
    inheriting its defaults for those it does not need; the host and the warm pool call them
    directly.
    """

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        """Run ``command`` in the persistent shell (cwd and environment carry over)."""

    def interrupt(self) -> None:
        """Kill the running command's processes; the shell stays usable."""

    def read_file(self, path: str) -> bytes:
        """Bytes of a file inside the sandbox. Paths are relative to the workspace or absolute
        inside it; a path that leads outside (``..``, a symlink) is a ``PermissionError``."""

    def write_file(self, path: str, data: bytes) -> None:
        """Create or replace a file inside the sandbox (parents created)."""

    def stat(self, path: str) -> StatResult:
        """Kind, size, mode and mtime of a path inside the sandbox, a symlink not followed;
        the path rules of :meth:`read_file`."""

    def export_tree(self, paths: list[str], max_bytes: int) -> bytes:
        """A tar of the files at the absolute ``paths`` inside the sandbox (each a file or a whole
        directory), built by the host from its side, never by a tool inside: names relative to
        ``/`` without ``..``, only regular files, directories and symlinks (stored as symlinks,
        never followed; a symlink on the way to a path is a ``PermissionError``), modes kept,
        owners 0:0, missing paths skipped. Larger than ``max_bytes``: ``FileTooLarge``. Paths
        beyond the workspace (and ``/logs``) need a ``writable_root`` sandbox."""

    def finish(self, paths: list[str], max_bytes: int, settle_s: float = 0.0) -> FinishResponse:
        """Kill every process of the sandbox, then read ``paths`` (the rules of
        :meth:`export_tree`: the workspace, ``/logs``, the root of a ``writable_root`` sandbox)
        from the host's side, then close it. ``files``: each path -> its bytes, or None when it
        is missing or not a regular file (more than ``max_bytes`` in all: ``FileTooLarge``);
        ``mtimes_ns``: each file's modification time; ``rewritten``: the paths that changed while
        they were watched for ``settle_s`` before the kill (something still running wrote them).
        What is read was written before the kill: nothing of the sandbox runs any more."""

    def close(self) -> None:
        """Kill everything the sandbox started and remove its files. Idempotent."""

    def info(self) -> dict[str, Any]:
        """Runtime, pid, workdir and whatever the runtime can tell about itself."""


class SandboxRuntime:
    """The optional hooks of a runtime class, with the defaults a runtime that needs none of
    them inherits. The sandbox host, its warm pool and the registry call them directly, and
    :func:`sandboxes.check.check_runtime_class` checks that every runtime has them. What is
    special about one runtime is said here, by the runtime, never by its name elsewhere."""

    name: ClassVar[str] = ""
    isolation: ClassVar[str] = "unknown"  # how its sandboxes are isolated, as /healthz shows
    # What 'auto' prefers: the available runtime of the highest rank the operator allows; 0: never
    auto_rank: ClassVar[int] = 0

    @classmethod
    def available(cls, config: dict[str, Any] | None = None) -> bool:
        """Whether the runtime can start sandboxes on this machine with ``config`` (the host's
        config for it: a binary to use ...). Default: yes."""
        return True

    @classmethod
    def strays(cls, config: dict[str, Any] | None = None) -> list[Stray]:
        """Containers of this runtime on this node that live outside a host's process tree
        (Apptainer's instances) and so may outlive the host that started them. The sweep asks
        every host for them and has those of ended or unknown jobs stopped. Default: none."""
        return []

    @classmethod
    def stop_stray(cls, name: str, config: dict[str, Any] | None = None) -> None:
        """Stop the stray container ``name`` (one :meth:`strays` listed)."""
        raise NotImplementedError(f"{cls.__name__} lists no strays")

    @classmethod
    def warm_spec(cls, spec: SandboxSpec) -> SandboxSpec | None:
        """The part of ``spec`` fixed when a sandbox starts (image, network), for the warm pool
        to pre-start one (:mod:`sandboxes.host.warm`). Default: None, never pre-started."""
        return None

    def claim(self, job_id: str, spec: SandboxSpec) -> None:
        """Hand a pre-started sandbox to ``job_id``, applying the rest of ``spec`` (env,
        limits, workdir). Only called on runtimes whose :meth:`warm_spec` returns a spec."""
        raise NotImplementedError(f"{type(self).__name__} cannot be pre-started")

    def open_file(self, path: str) -> IO[bytes] | None:
        """For the host's read route: the file at ``path`` opened (and size-checked) to be
        streamed, under :meth:`read_file`'s path rules. Default: None, and the host answers
        with :meth:`read_file`'s bytes."""
        return None

    def export_tree(self, paths: list[str], max_bytes: int) -> bytes:
        """:meth:`Sandbox.export_tree`. Default: not offered by this runtime."""
        raise NotImplementedError(f"{type(self).__name__} cannot export its files")

    def finish(self, paths: list[str], max_bytes: int, settle_s: float = 0.0) -> FinishResponse:
        """:meth:`Sandbox.finish`. Default: not offered by this runtime."""
        raise NotImplementedError(f"{type(self).__name__} cannot finish (kill, then read)")

    def freeze(self, layer: str, group_id: str | None = None, job_id: str | None = None,
               timeout: float = 600.0) -> LayerEntry:
        """Kill every process of the sandbox, freeze its root's changes into the layer ``layer``
        (which other sandboxes may then name in ``spec.layers``), then close it. Default: not
        offered by this runtime (only a ``writable_root`` sandbox has changes to freeze)."""
        raise NotImplementedError(f"{type(self).__name__} cannot freeze its root into a layer")

    def kill(self) -> None:
        """Stop everything the sandbox runs at once; ``close()`` (idempotent) finishes later,
        in the background. Default: close now."""
        self.close()  # type: ignore[attr-defined]  # every Sandbox has close()

    def netns_fd(self) -> int | None:
        """A new descriptor of the sandbox's own network namespace (the caller closes it), for the
        host's forwards between sandboxes (:mod:`sandboxes.host.forward`). Default: None, the
        runtime has none of its own to give."""
        return None

    def usage(self) -> dict[str, Any] | None:
        """What the sandbox used, as its cgroup counts it: ``{"cpu_s", "peak_memory_mb"}`` (see
        :meth:`sandboxes.runtimes.limits.cgroups.SandboxCgroup.usage`), now while it lives and the
        last reading once closed; the host reads it at close and in ``info``. Default: None, not
        measured (never a guess): the runtime keeps no cgroup of its own per sandbox."""
        return None

    def hasten_exit(self) -> None:
        """Just before :meth:`kill`: once killed, let this sandbox's processes have the CPU
        before the living until they are gone (a bulk close calls it for each sandbox before
        killing any). Default: nothing."""


def gateway_dir() -> str | None:
    """The node's directory of harness gateway sockets (``settings.gateway_socket_dir``; made here,
    0711: a sandbox may enter it, never list it), or None when there is none. bwrap binds it into
    every sandbox; a session's socket in it is the sandbox's one way out (tasks.harnesses.run)."""
    from config.settings import get_settings

    path = get_settings().gateway_socket_dir
    if not path:
        return None
    try:
        os.makedirs(path, exist_ok=True)
        if os.stat(path).st_uid == os.getuid():  # whatever the umask (worker_node.sh sets 077): 0700
            os.chmod(path, 0o711)  # would shut every sandbox uid out of its own socket
    except OSError:
        pass
    return path if os.path.isdir(path) else None
