"""The host-side directory of a bwrap sandbox whose image root is writable (``writable_root``).

One directory per sandbox (its workspace filesystem where the node gives one, so the root's
changes count against ``disk_mb``), owned by the sandbox's uid except the mount point::

    <box>/ws      the workspace, bound at /workspace
    <box>/logs    bound at /logs: what graders read from the host once the sandbox is dead
    <box>/upper   the overlay's upper layer: every change the sandbox made to its root
    <box>/work    the overlay's work directory
    <box>/root    where the overlay is bound, in the sandbox's own mount namespace only

Below the upper layer: the image, and above it any frozen layers the spec names (a group's
prepared root, :mod:`sandboxes.runtimes.layers`); :meth:`WritableRoot.freeze` makes one.

The overlay itself (:mod:`sandboxes.runtimes.limits.idmap`) is a descriptor this object holds
until :meth:`close`; everything under ``<box>`` goes with the workspace (retired, then removed
by descriptor), and a dead host's boxes with the reaping of its workspace root.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from prorl_celery.errors import SandboxGone
from sandboxes.runtimes import layers
from sandboxes.protocol import LayerEntry
from sandboxes.runtimes.limits import idmap
from sandboxes.runtimes.workspace import open_beneath, split

WORKSPACE, LOGS, UPPER, WORK, MOUNTPOINT = "ws", "logs", "upper", "work", "root"
LOGS_MOUNT = "/logs"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class WritableRoot:
    """The overlay root of one sandbox, made in ``box`` for the sandbox uid ``uid``; ``layers``:
    frozen layers' trees above the image (:mod:`sandboxes.runtimes.layers`), topmost first."""

    def __init__(self, box: Path, image: str, uid: int, layers: list[str] | None = None):
        self.box, self.uid = box, uid
        self._lock = threading.Lock()  # a descriptor is never used by number once closed
        for name in (WORKSPACE, LOGS, UPPER, WORK, MOUNTPOINT):
            path = box / name
            path.mkdir(mode=0o755, exist_ok=True)
            if name != MOUNTPOINT:
                os.chown(path, uid, uid)
        self.fd: int | None = idmap.writable_root(image, str(box / UPPER), str(box / WORK), uid, layers or [])

    @property
    def mountpoint(self) -> str:
        return str(self.box / MOUNTPOINT)

    @property
    def logs_dir(self) -> str:
        return str(self.box / LOGS)

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` (the sandbox's bwrap) started with the overlay bound at :attr:`mountpoint`."""
        return idmap.bind_argv(argv, self.fd, self.mountpoint)

    def bases(self, box: Path) -> dict[str, str | int]:
        """For :mod:`sandboxes.runtimes.export`: ``/logs`` and the root, a new descriptor the
        caller closes (``box``: the box where it is now, retired or not)."""
        with self._lock:
            if self.fd is None:
                raise SandboxGone("the sandbox's root is gone (closed)")
            return {LOGS_MOUNT: str(box / LOGS), "/": os.dup(self.fd)}

    def makedirs(self, path: str) -> None:
        """Make the directory ``path`` of the root (no symlink followed), owned by the sandbox:
        a working directory the image lacks (bwrap cannot start in one that does not exist)."""
        with self._lock:
            fd = os.dup(self.fd)
        try:
            for part in split(path):
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    made = True
                except FileExistsError:
                    made = False
                new = open_beneath(fd, part, _DIR & ~os.O_NOFOLLOW, no_symlinks=True)
                os.close(fd)
                fd = new
                if made:
                    os.fchown(fd, self.uid, self.uid)
        finally:
            os.close(fd)

    def freeze(self, name: str, group_id: str | None, job_id: str | None, timeout: float) -> LayerEntry:
        """The root's changes frozen into the layer ``name`` (the overlay let go first: call it
        once nothing of the sandbox runs)."""
        self.close()
        return layers.freeze(self.box / UPPER, self.uid, name, group_id, job_id, timeout)

    def close(self) -> None:
        """Let the overlay go (the kernel drops it once the sandbox's namespace is gone too)."""
        with self._lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
