"""Workspace filesystems kept out of the mount table that every sandbox start copies.

Each bwrap sandbox starts in a copy of its parent's mount namespace, and bubblewrap reads the
whole of ``/proc/self/mountinfo`` for each of its binds. With one ext4 workspace mounted per
sandbox (:mod:`sandboxes.runtimes.limits.diskquota`), the N-th start on a host copies and parses N of them:
measured here, ``bwrap ... true`` took 14.9 ms beside 88 mounts and 47.7 ms beside 688, so a
burst of a thousand creates costs O(N^2) and slows to a crawl.

So a root sandbox host, at start and while it is still one thread, keeps a handle on the mount
namespace it was started in (the node's: "clean") and moves itself into a private copy of it
(a slave: mounts the node makes later still appear), where it mounts the workspaces and works
on their files. A sandbox starts from the clean namespace instead (``nsenter``), in a private
copy of its own (``unshare``) in which only its own workspace is mounted (the same ext4 device:
the kernel hands out the same superblock, so host and sandbox see the same files). The
processes exec one into the next (no forks), so the sandbox's process tree is unchanged.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

_CLONE_NEWNS, _MS_REC, _MS_SLAVE = 0x00020000, 0x4000, 0x80000
_libc = ctypes.CDLL(None, use_errno=True)
_TOOLS = {name: shutil.which(name) for name in ("nsenter", "unshare", "mount")}
# writes its pid into each file before "--" (joins those cgroups), then shifts them off
JOIN_CGROUPS = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 126; shift; done; shift; '
# joins the sandbox's cgroups, mounts its own workspace in its private namespace, then execs
# the rest of argv: one shell for both (each exec of a shell costs about half a millisecond)
_MOUNT_SHIM = (JOIN_CGROUPS + f'{_TOOLS["mount"]} -n -t ext4 -o nosuid,nodev -- "$1" "$2" || exit 125; '
               'shift 2; exec "$@"')
_clean: str | None = None  # /proc/<host pid>/fd/<n>: the namespace sandboxes start from


def separate() -> bool:
    """Move this process into a private mount namespace, keeping the current one for sandboxes
    to start from. Only as root, only while single-threaded (``unshare`` would move just the
    calling thread), only with nsenter, unshare and mount at hand; True when done."""
    global _clean
    from config.settings import get_settings

    if _clean is not None:
        return True
    if not get_settings().sandbox_private_mounts or os.geteuid() != 0 or threading.active_count() > 1 or not all(_TOOLS.values()):
        return False
    fd = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    if _libc.unshare(_CLONE_NEWNS) != 0 or _libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) != 0:
        err = ctypes.get_errno()
        os.close(fd)
        log.warning("workspace mounts stay in the node's namespace: %s", os.strerror(err))
        return False
    _clean = f"/proc/{os.getpid()}/fd/{fd}"
    return True


def separated() -> bool:
    return _clean is not None


def applies(device: str | None) -> bool:
    """Whether :func:`enter_argv` starts a sandbox on ``device`` from the clean namespace."""
    return _clean is not None and bool(device)


def enter_argv(argv: list[str], device: str | None, directory: str,
               join: Sequence[str] = ()) -> list[str]:
    """``argv`` started from the clean namespace, in a private copy with ``device`` mounted at
    ``directory``, after joining the cgroups whose ``cgroup.procs`` files ``join`` names;
    unchanged when it does not :func:`apply <applies>`."""
    if not applies(device):
        return argv
    return [_TOOLS["nsenter"], f"--mount={_clean}", "--", _TOOLS["unshare"], "--mount",
            "--propagation", "private", "--", "/bin/sh", "-c", _MOUNT_SHIM, "sh", *join, "--",
            device, directory, *argv]
