"""How the parent bash of :class:`sandboxes.runtimes.shell.persistent.PersistentShell` comes to life: its
default argv and environment, its two extra pipes, its parent-death signal, the execute-only
copy of bash that keeps it out of the sandbox's reach, and what a shell started ahead of demand
must already match (:func:`shell_warm_spec`).

The status pipe is safe only while nothing in the sandbox can open the parent's fds or memory
(``/proc/<ppid>/fd``, ``/proc/<ppid>/mem``, ptrace), which needs the parent to be dumpable.
Where the host can make one (:func:`trusted_bash`), a runtime that runs its sandbox as another
user starts the parent from an execute-only copy of bash owned by root (:func:`trusted_argv`),
which makes it non-dumpable for a sandbox without ``CAP_SYS_PTRACE``; a ``local`` shell (the
host's own user), or a bwrap image without that copy, stays dumpable (the shell's
``status_channel`` says which).
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import stat
import subprocess
from collections.abc import Callable, Mapping, Sequence

from prorl_celery.spawn import spawn
from sandboxes.runtimes.shell.script import VALID_NAME, setup_script

log = logging.getLogger(__name__)

DEFAULT_ARGV = ("bash", "--noprofile", "--norc")

# Tools must never wait for a pager or emit colour codes into the agent's observation.
NONINTERACTIVE_ENV = {
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "MANPAGER": "cat",
    "TERM": "dumb",
    "NO_COLOR": "1",
    "LC_ALL": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
    "PIP_NO_INPUT": "1",
}

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)  # resolved before any fork; preexec only calls it
TRUSTED_BASH = "/usr/local/libexec/prorl/bash"  # under /usr: bound into every host-rooted sandbox


def trusted_bash() -> str | None:
    """An execute-only copy of bash owned by this (root) process: a bash exec'd from a file its
    user cannot read is not dumpable, so nothing in the sandbox can open its fds or memory."""
    if os.geteuid() != 0:
        return None
    if os.path.exists(TRUSTED_BASH):
        return TRUSTED_BASH
    source = shutil.which("bash")
    if not source:
        return None
    try:
        os.makedirs(os.path.dirname(TRUSTED_BASH), mode=0o755, exist_ok=True)
        staging = f"{TRUSTED_BASH}.{os.getpid()}.tmp"
        shutil.copyfile(source, staging)
        os.chmod(staging, stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(staging, TRUSTED_BASH)
    except OSError as exc:
        log.warning("no execute-only bash at %s (%s): shell parents stay dumpable", TRUSTED_BASH, exc)
        return None
    return TRUSTED_BASH


def trusted_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``bash`` replaced by :func:`trusted_bash` where the host has that copy."""
    trusted = os.path.basename(argv[0]) == "bash" and trusted_bash()
    return [trusted, *argv[1:]] if trusted else list(argv)


def shell_warm_spec(spec):
    """For a runtime built on this shell: the part of ``spec`` a pre-started sandbox must already
    match (image, network); env, limits and workdir are applied when it is claimed. None when the
    env cannot be applied later (a name the shell cannot export), or it names frozen layers (a
    warm sandbox would hold them)."""
    from sandboxes.base import SandboxSpec

    if not all(VALID_NAME.match(name) for name in spec.env) or spec.layers:
        return None  # a frozen layer's sandboxes start on demand: a warm one would hold it
    return SandboxSpec(runtime=spec.runtime, image=spec.image, network=spec.network,
                       writable_root=spec.writable_root)


def die_with_parent() -> None:
    """preexec: SIGKILL this child when the thread that spawned it dies (a kill -9 of the host)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn_parent(argv: Sequence[str], cwd: str, env: Mapping[str, str], state_name: str,
                 preexec: Callable[[], None] | None, extra_fds: Sequence[int] = ()
                 ) -> tuple[subprocess.Popen, int, int, int]:
    """Start the parent with its status pipe's write end and a pipe holding its setup script
    (:func:`~sandboxes.runtimes.shell.script.setup_script`), which it sources in one read: bash
    reads commands from its stdin a byte at a time. Returns the process, the status pipe's read
    end, and the numbers the parent knows the status pipe's write end and the setup pipe by
    (both closed here). ``extra_fds``: more descriptors the parent inherits (a runtime's
    argv closes them before the shell runs)."""
    status_r, status_w = os.pipe()
    init_r, init_w = os.pipe()
    try:
        try:
            os.write(init_w, setup_script(state_name, status_w).encode())  # < 64 KiB
        finally:
            os.close(init_w)
        os.fchmod(init_r, 0o444)  # bash reopens it by /dev/fd as the sandbox's user, not ours
        proc = spawn(
            list(argv), cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec, bufsize=0,
            pass_fds=(status_w, init_r, *extra_fds))
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
        os.close(init_r)
    return proc, status_r, status_w, init_r


def remove_own_file(path: str) -> None:
    """Remove a local shell's state file: only a regular file this process owns."""
    try:
        info = os.lstat(path)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            os.unlink(path)
    except OSError:
        pass
