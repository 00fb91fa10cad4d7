"""One long-lived bash per sandbox: a command costs a pipe round trip, not a process start.

Each command is sent as one ``eval`` line followed by a ``printf`` of a per-shell nonce, the exit
status and ``$PWD``; the output is everything before that marker. The runtime supplies the argv
(``bash`` locally, ``bwrap ... bash`` or ``singularity exec ... bash`` later), so the shell never
knows how it is isolated.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import secrets
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from prorl_celery.errors import SandboxError, SandboxGone
from prorl_celery.procs import spawn
from sandboxes.base import ExecResult, Limits
from sandboxes.guardian import guardian
from sandboxes.output import Output, cut_middle
from sandboxes.procs import group_members, kill_descendants, kill_pids, ulimit_command, wait_dead

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

KILL_GRACE_S = 1.5  # after killing a command's processes, how long the shell gets to print the marker
START_TIMEOUT_S = 30.0
_READ_CHUNK = 1 << 16
_PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)  # resolved before any fork; preexec only calls it
VALID_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def shell_warm_spec(spec):
    """For a runtime built on this shell: the part of ``spec`` a pre-started sandbox must already
    match (image, network); env, limits and workdir are applied when it is claimed. None when the
    env cannot be applied later (a name the shell cannot export)."""
    from sandboxes.base import SandboxSpec

    if not all(VALID_NAME.match(name) for name in spec.env):
        return None
    return SandboxSpec(runtime=spec.runtime, image=spec.image, network=spec.network)


def die_with_parent() -> None:
    """preexec: SIGKILL this child when the thread that spawned it dies (a kill -9 of the host)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


class PersistentShell:
    """A bash process that runs one command at a time, keeping cwd and environment between them."""

    def __init__(self, argv: Sequence[str] = DEFAULT_ARGV, cwd: str | None = None,
                 env: Mapping[str, str] | None = None, *, output_limit: int | None = None,
                 preexec_fn: Callable[[], None] | None = None, default_timeout: float | None = None,
                 limits: Limits | None = None, guarded: bool = True):
        """``env``: the shell's environment, the non-interactive defaults filling what it lacks;
        None: this process's environment, overridden by those defaults. ``limits``: rlimits set
        on the shell once it runs. ``guarded``: the guardian kills the shell and all it runs if
        this process dies (False when the argv sees to it itself, as ``bwrap --die-with-parent``
        does)."""
        from config.settings import get_settings

        settings = get_settings()
        self.argv = list(argv)
        self.initial_cwd = cwd or os.getcwd()
        self.cwd = self.initial_cwd
        self.env = ({**os.environ, **NONINTERACTIVE_ENV} if env is None
                    else {**NONINTERACTIVE_ENV, **env})
        self.output_limit = output_limit or settings.output_limit_chars
        self.default_timeout = default_timeout or settings.action_timeout_s
        self.limits = limits
        self._preexec_fn = preexec_fn
        self._guarded = guarded
        self._nonce = secrets.token_hex(12)
        self._marker = f"\n{self._nonce} ".encode()
        self._lock = threading.Lock()
        self._interrupted = threading.Event()
        self._running = False
        self._closed = False
        self._reaped = False
        self._killed: list[int] = []
        self._close_lock = threading.Lock()
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._start(self.initial_cwd)

    # -- process lifecycle -------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The process we started (for a wrapped shell, the wrapper)."""
        return self._proc.pid if self._proc else None

    @property
    def shell_pid(self) -> int | None:
        """The bash process itself; its descendants are the running command's processes."""
        return self.pid

    @property
    def closed(self) -> bool:
        return self._closed

    def _preexec(self) -> None:
        if self._preexec_fn:
            self._preexec_fn()
        die_with_parent()  # last: a change of uid in the preexec would clear it

    def _start(self, cwd: str) -> None:
        # A preexec_fn makes Popen fork the whole host process instead of vfork-ing (ms per start
        # on a big host), so parent death is the guardian's business unless the caller brings one.
        preexec = self._preexec if self._preexec_fn is not None else None
        self._proc = spawn(
            self.argv, cwd=cwd, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec, bufsize=0)
        if self._guarded and preexec is None:
            guardian().hold(self._proc.pid)
        self._fd = self._proc.stdout.fileno()
        out, state = self._roundtrip(":", time.monotonic() + START_TIMEOUT_S, phase="start")
        if state == "marker":
            try:
                self._started()
                return
            except OSError as exc:
                state = f"setup failed: {exc}"
        self._kill_all()
        self._reap()
        raise SandboxError(f"shell {self.argv!r} did not start ({state}): {out.text()[-2000:]!r}")

    def _started(self) -> None:
        """Runs once the shell answered: the shell limits itself (and so all it starts)."""
        command = self.limits and ulimit_command(self.limits)
        if command:
            out, state = self._roundtrip(command, time.monotonic() + START_TIMEOUT_S, phase="start")
            if state != "marker" or out.status != 0:
                raise OSError(f"could not set limits ({state}): {out.text()[-500:]!r}")

    def _kill_command(self) -> list[int]:
        """SIGKILL what the current command started: the shell's descendants, and what left
        the tree but not the shell's process group (``(cmd &)`` orphans)."""
        if not self._proc:
            return []
        killed = kill_descendants(self.shell_pid)
        strays = [pid for pid in group_members(self._proc.pid) if pid != self.shell_pid]
        return killed + kill_pids(strays)

    def _kill_all(self) -> list[int]:
        """SIGKILL the shell's process group and any descendant that left it (setsid)."""
        if self._proc is None:
            return []
        killed = kill_descendants(self._proc.pid)
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return killed

    def _reap(self) -> None:
        """Close our pipe ends and wait for the shell; only called by the thread holding the fds."""
        proc = self._proc
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.error("shell pid %s did not die after SIGKILL", proc.pid)
        else:
            guardian().drop(proc.pid)

    def _restart(self) -> str:
        """A new shell in the initial directory, then back to where the old one was."""
        self._kill_all()
        self._reap()
        last = self.cwd
        self.restarts += 1
        self._start(self.initial_cwd)
        if last != self.cwd:
            self._roundtrip(f"cd -- {shell_quote(last)}", time.monotonic() + START_TIMEOUT_S,
                            phase="start")
        return self.cwd

    def adopt(self, env: Mapping[str, str], limits: Limits | None, cwd: str | None) -> None:
        """Make a shell started ahead of demand look as if it had been started with these:
        variables exported (and kept for restarts), limits set, current directory changed."""
        names = [name for name in env if not VALID_NAME.match(name)]
        if names:
            raise SandboxError(f"cannot export variables named {names!r}")
        self.env.update(env)
        self.limits = limits
        parts = [f"export {name}={shell_quote(value)}" for name, value in env.items()]
        parts += [command] if limits and (command := ulimit_command(limits)) else []
        parts += [f"cd -- {shell_quote(cwd)}"] if cwd else []
        if parts:
            with self._lock:
                out, state = self._roundtrip(" && ".join(parts), time.monotonic() + START_TIMEOUT_S,
                                             phase="start")
            if state != "marker" or out.status != 0:
                raise SandboxError(f"could not prepare the shell ({state}): {out.text()[-500:]!r}")

    def kill(self) -> None:
        """SIGKILL everything now without waiting; :meth:`close` reaps it later."""
        self._closed = True
        self._killed += self._kill_all()

    def close(self) -> None:
        """Kill the shell's whole process group and reap it. Idempotent, safe from any thread."""
        with self._close_lock:
            if self._reaped:
                return
            self._closed = True
            killed = self._killed + self._kill_all()
            # A running command notices _closed within one poll and releases the lock; the fds
            # are closed only under the lock so that no reader ever selects on a recycled fd.
            if self._lock.acquire(timeout=10):
                try:
                    killed += self._kill_all()  # again: a restart may have started a new shell
                    self._reap()
                finally:
                    self._lock.release()
            wait_dead(killed, timeout=2)
            self._reaped = True

    # -- commands ----------------------------------------------------------------------------

    def interrupt(self) -> None:
        """Kill the running command's processes; :meth:`run` returns with ``interrupted=True``."""
        if self._running and self._proc:
            self._interrupted.set()
            self._kill_command()

    def run(self, command: str, timeout: float | None = None) -> ExecResult:
        """Run ``command``; output is stdout and stderr interleaved, cut in the middle if too long."""
        with self._lock:
            if self._closed:
                raise SandboxGone("the shell was closed")
            self._interrupted.clear()
            self._running = True
            started = time.monotonic()
            try:
                result = self._run_locked(command, started + (timeout or self.default_timeout))
            finally:
                self._running = False
            result.duration_s = time.monotonic() - started
            return result

    def _run_locked(self, command: str, deadline: float) -> ExecResult:
        out, state = self._roundtrip(command, deadline)
        if self._closed:
            raise SandboxGone("the shell was closed while a command ran")
        interrupted = self._interrupted.is_set()
        timed_out = state == "timeout" and not interrupted
        note = None
        if state == "timeout":
            why = "interrupted" if interrupted else "timed out"
            state = self._read_until_marker(out, time.monotonic() + KILL_GRACE_S, phase="recover")
            note = f"[command {why}; its processes were killed]"
            if state != "marker":
                note = (f"[command {why}; the shell did not recover and was restarted in "
                        f"{self._restart()}; exported variables and functions were lost]")
            else:  # reap the killed jobs now, so bash's "Killed ..." notices do not leak into
                # the next command's output
                self._roundtrip("wait", time.monotonic() + KILL_GRACE_S, phase="recover")
        elif state == "eof":  # the command ended the shell: exit, exec, set -e ...
            try:
                out.status = self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                out.status = None
            note = (f"[the shell exited with status {out.status}; a new shell was started in "
                    f"{self._restart()}; exported variables and functions were lost]")
        output, truncated = cut_middle(out.text(), self.output_limit, out.dropped)
        if note:
            output = f"{output}\n{note}" if output else note
        return ExecResult(output=output, exit_code=None if timed_out or interrupted else out.status,
                          timed_out=timed_out, interrupted=interrupted, truncated=truncated)

    def _roundtrip(self, command: str, deadline: float, phase: str = "command") -> tuple[Output, str]:
        out = Output(self.output_limit, self._marker)
        line = (f"eval {shell_quote(command)} </dev/null 2>&1; "
                f"printf '\\n{self._nonce} %d %s\\n' \"$?\" \"$PWD\"\n")
        try:
            self._write(line.encode("utf-8", errors="surrogateescape"))
        except (OSError, ValueError):
            return out, "eof"  # the shell is already gone
        return out, self._read_until_marker(out, deadline, phase)

    def _write(self, data: bytes) -> None:
        fd = self._proc.stdin.fileno()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    def _read_until_marker(self, out: Output, deadline: float, phase: str = "command") -> str:
        """Read into ``out``; returns "marker", "eof" or "timeout" (also on close, and on interrupt
        while a command runs). ``phase``: "command", "recover" (keep killing) or "start"."""
        stop_on_interrupt, kill_each_poll = phase == "command", phase == "recover"
        while True:
            if out.parse_marker():
                if out.pwd:
                    self.cwd = out.pwd
                return "marker"
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed or (stop_on_interrupt and self._interrupted.is_set()):
                return "timeout"
            if kill_each_poll:  # a fork loop may have spawned more since the last kill
                self._kill_command()
            try:
                ready, _, _ = select.select([self._fd], [], [], min(remaining, 0.05))
                chunk = os.read(self._fd, _READ_CHUNK) if ready else None
            except (OSError, ValueError):
                chunk = b""
            if chunk == b"":
                return "eof"
            if chunk:
                out.add(chunk)
