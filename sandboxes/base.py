"""The sandbox interface: where an agent's commands run.

A runtime (``local``, ``bwrap``, ``singularity``) implements :class:`Sandbox`; a sandbox host
serves sandboxes of any runtime over HTTP, and :class:`sandboxes.client.RemoteSandbox` drives one
from any node by its :class:`SandboxHandle`.
"""
from __future__ import annotations

from typing import IO, Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    memory_mb: int | None = Field(None, description="Address-space limit per process, MiB.")
    cpu_s: int | None = Field(None, description="CPU time limit per process, seconds.")
    nproc: int | None = Field(None, description="Maximum number of processes.")
    fsize_mb: int | None = Field(None, description="Largest file a process may write, MiB.")
    wall_s: float | None = Field(None, description="Wall time after which the whole sandbox is killed.")


class SandboxSpec(BaseModel):
    """What an instance's ``sandbox`` block may ask for; the runtime picks what it understands."""

    model_config = ConfigDict(extra="forbid")

    runtime: str | None = Field(None, description="Runtime name or dotted path; default from settings.")
    image: str | None = Field(None, description="Image: rootfs directory (bwrap) or .sif / docker:// (singularity).")
    limits: Limits = Field(default_factory=Limits, description="Resource limits.")
    network: bool = Field(False, description="Allow network access from inside the sandbox.")
    workdir: str | None = Field(None, description="Directory the shell starts in (inside the sandbox).")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the shell.")


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
    """A live sandbox with one persistent shell."""

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        """Run ``command`` in the persistent shell (cwd and environment carry over)."""

    def interrupt(self) -> None:
        """Kill the running command's processes; the shell stays usable."""

    def read_file(self, path: str) -> bytes:
        """Bytes of a file inside the sandbox. Paths are relative to the workspace or absolute
        inside it; a path that leads outside (``..``, a symlink) is a ``PermissionError``."""

    def write_file(self, path: str, data: bytes) -> None:
        """Create or replace a file inside the sandbox (parents created)."""

    def put_archive(self, dest: str, archive: IO[bytes]) -> int:
        """Unpack an uncompressed tar stream at ``dest`` inside the sandbox; returns members."""

    def get_archive(self, src: str, out: IO[bytes]) -> None:
        """Write an uncompressed tar of ``src`` (a directory's contents, or a file) to ``out``."""

    def copy_in(self, src_dir: str, dest: str) -> int:
        """Copy a directory of the caller's machine into the sandbox at ``dest``."""

    def copy_out(self, src: str, dest_dir: str) -> None:
        """Copy ``src`` from the sandbox into a directory of the caller's machine."""

    def close(self) -> None:
        """Kill everything the sandbox started and remove its files. Idempotent."""

    def info(self) -> dict[str, Any]:
        """Runtime, pid, workdir and whatever the runtime can tell about itself."""
