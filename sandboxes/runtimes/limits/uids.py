"""One host uid per sandbox, when the sandbox host runs as root.

A sandbox started by root would run as host uid 0: ``RLIMIT_NPROC`` does not apply to uid 0 (a
fork bomb is not stopped) and a root-owned process keeps powers over root-owned files. So a root
host starts each sandbox as its own unprivileged uid from a range. A uid is taken by holding an
``flock`` on a file named after it, which also keeps two hosts on one node apart and frees the
uid by itself when a host dies. The lock directory must be this host's own (see
:func:`sandboxes.safedirs.private_dir`: another user's, a world-writable one or a symlink is
refused) and the lock files are opened without following symlinks.
"""
from __future__ import annotations

import fcntl
import os
import random
import tempfile

from prorl_celery.errors import NoSandboxCapacity
from sandboxes.safedirs import private_dir


def default_lock_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "prorl-sandbox-uids")


class UidLease:
    """A uid held until :meth:`release` (or until this process dies)."""

    def __init__(self, uid: int, fd: int):
        self.uid = uid
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None


_checked: set[str] = set()


def checked_lock_dir(lock_dir: str) -> str:
    """``lock_dir``, made or checked once per process (0700, ours, nobody else can write it)."""
    if lock_dir not in _checked:
        private_dir(lock_dir, 0o700)
        _checked.add(lock_dir)
    return lock_dir


def lease_uid(base: int, count: int, lock_dir: str | None = None) -> UidLease:
    """A free uid in ``[base, base + count)``; starts at a random place so hosts rarely collide."""
    lock_dir = str(checked_lock_dir(lock_dir or default_lock_dir()))
    start = random.randrange(count)
    for step in range(count):
        uid = base + (start + step) % count
        fd = os.open(os.path.join(lock_dir, str(uid)),
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return UidLease(uid, fd)
    raise NoSandboxCapacity(f"all {count} sandbox uids from {base} are in use")
