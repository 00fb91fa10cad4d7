"""Child processes started so that they die with this process (every process of the service uses it)."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so every child is forked
# from this one thread, which lives as long as the process.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="child-spawner")


def spawn(*args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` from the process's spawner thread: a child whose parent-death signal
    is set (by a preexec, or by ``bwrap --die-with-parent``) dies with this process, not with
    whichever short-lived thread happened to start it."""
    return _spawner.submit(subprocess.Popen, *args, **kwargs).result()
