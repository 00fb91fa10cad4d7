"""One long-lived bash per sandbox: a command costs a pipe round trip, not a process start.

The exit status comes through a channel the command cannot reach. The long-lived bash (the
*parent*) never runs the agent's code: each command runs in a forked subshell ``( ... )`` that
first closes the parent's status fd and replaces its stdin, then sources the state the previous
command left (cwd, exported variables, functions, aliases, shell options), runs the command with
``eval``, and dumps its state for the next one. The parent, whose functions and builtins the
agent never touched, writes ``$?`` and the cwd to the status pipe, which only this process reads;
the output is everything on stdout until then. So a redefined ``printf``/``builtin``/``command``,
``enable -n``, traps, ``PROMPT_COMMAND``, ``exec`` of another shell or a printed fake marker
change only the subshell. What is left is reaching the parent from outside (its fds, its
memory), which :mod:`sandboxes.runtimes.shell.spawn` closes where the host can: ``status_channel``
says whether it did. Killing the parent yields no status (``exit_code`` None), never a forged one.

Starting costs one round trip: the parent sources its setup script from a pipe in one read
(bash reads its stdin a byte at a time) and runs the runtime's own commands (exports, limits).

The runtime supplies the argv (``bash`` locally, ``bwrap ... bash`` or ``singularity exec ...
bash``), so the shell never knows how it is isolated.
"""
from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from prorl_celery.errors import SandboxError, SandboxGone
from sandboxes.base import ExecResult, Limits
from sandboxes.runtimes.shell.guardian import guardian
from sandboxes.runtimes.shell.output import cut_middle
from sandboxes.runtimes.procs import group_members, kill_descendants, kill_pids, ulimit_command, wait_dead
from sandboxes.runtimes.shell.channel import ShellChannel
from sandboxes.runtimes.shell.script import STATE_SUFFIXES, VALID_NAME, shell_quote
from sandboxes.runtimes.shell.spawn import (DEFAULT_ARGV, NONINTERACTIVE_ENV, die_with_parent, remove_own_file,
                                           spawn_parent)

log = logging.getLogger(__name__)

KILL_GRACE_S = 1.5  # after killing a command's processes, how long the shell gets to print the marker
START_TIMEOUT_S = 30.0


class PersistentShell(ShellChannel):
    """A bash process that runs one command at a time, keeping cwd and environment between them."""

    def __init__(self, argv: Sequence[str] = DEFAULT_ARGV, cwd: str | None = None,
                 env: Mapping[str, str] | None = None, *, output_limit: int | None = None,
                 preexec_fn: Callable[[], None] | None = None, default_timeout: float | None = None,
                 limits: Limits | None = None, guarded: bool = True, pass_fds: Sequence[int] = ()):
        """``env``: the shell's environment, the non-interactive defaults filling what it lacks;
        None: this process's environment, overridden by those defaults. ``limits``: rlimits set
        on the shell once it runs. ``guarded``: the guardian kills the shell and all it runs if
        this process dies (False when the argv sees to it itself, as ``bwrap --die-with-parent``
        does). ``pass_fds``: descriptors every start of the shell inherits (the caller keeps
        them open while the shell may restart)."""
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
        self.pass_fds = tuple(pass_fds)
        self._state_name = f"prorl-shell.{secrets.token_hex(8)}"
        self._status_fd: int | None = None
        self._state_base = ""  # where the shell keeps its state files (for a local shell, host paths)
        self._status_w = self._setup_fd = -1
        self.status_channel = "unknown"
        self._lock = threading.Lock()
        self._interrupted = threading.Event()
        self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._running = False
        self._closed = False
        self._reaped = False
        self._killed: list[int] = []
        self._killed_all = False  # kill() ran: close() kills once more under the lock only
        self._close_lock = threading.Lock()
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        try:
            self._start(self.initial_cwd)
        except BaseException:
            os.close(self._wake_fd)  # no close() follows a shell that never started
            raise

    # -- process lifecycle -------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The process we started (for a wrapped shell, the wrapper)."""
        return self._proc.pid if self._proc else None

    @property
    def shell_pid(self) -> int | None:
        """The bash process itself; its descendants are the running command's processes."""
        return self.pid

    def exit_fd(self) -> int | None:
        """A new pidfd of the process started (the caller closes it): it turns readable when
        that process exits. None once it was reaped (its pid may be another's by then)."""
        with self._close_lock:
            if self._proc is None or self._reaped or self._proc.returncode is not None:
                return None
            try:
                return os.pidfd_open(self._proc.pid)
            except OSError:
                return None

    @property
    def closed(self) -> bool:
        return self._closed

    def _preexec(self) -> None:
        if self._preexec_fn:
            self._preexec_fn()
        die_with_parent()  # last: a change of uid in the preexec would clear it

    def _start(self, cwd: str) -> None:
        self._spawn(cwd)
        # plain "exec": "builtin exec N<&-" would close the fd only while that command runs
        line = " && ".join([f"builtin . /dev/fd/{self._setup_fd} && exec {self._setup_fd}<&-",
                            *self._start_commands(), 'builtin eval "$__prorl_I"'])
        out, state = self._roundtrip(line, time.monotonic() + START_TIMEOUT_S, phase="start",
                                     raw=True, info='"$__prorl_D $__prorl_B $PWD"', rebase="")
        if state == "marker" and out.status != 0:
            state = f"setup failed (status {out.status})"
        if state == "marker":
            try:
                self._took_setup(out.pwd or "")
                self._started()
                return
            except OSError as exc:
                state = f"setup failed: {exc}"
        self._kill_all()
        self._reap()
        raise SandboxError(f"shell {self.argv!r} did not start ({state}): {out.text()[-2000:]!r}")

    def _spawn(self, cwd: str) -> None:
        """Start the parent (:func:`~sandboxes.runtimes.shell.spawn.spawn_parent`) and take its pipes."""
        # A preexec_fn makes Popen fork the whole host process instead of vfork-ing (ms per start
        # on a big host), so parent death is the guardian's business unless the caller brings one.
        preexec = self._preexec if self._preexec_fn is not None else None
        self._proc, status_r, self._status_w, self._setup_fd = spawn_parent(
            self.argv, cwd, self.env, self._state_name, preexec, self.pass_fds)
        self._status_fd, self._status_buf, self._token = status_r, b"", b""
        if self._guarded and preexec is None:
            guardian().hold(self._proc.pid)
        self._fd = self._proc.stdout.fileno()

    def _took_setup(self, info: str) -> None:
        """The setup's answer: "<dumpable|non-dumpable> <state base> <cwd>"; the state base
        ends in this shell's own state name, so a space in it (TMPDIR) does not confuse."""
        dumpable, _, rest = info.partition(" ")
        base, found, cwd = rest.partition(f"/{self._state_name} ")
        if not found or not cwd:
            raise OSError(f"unexpected setup answer {info!r}")
        self._state_base, self.cwd = f"{base}/{self._state_name}", cwd
        self.status_channel = f"status pipe, parent {dumpable}"

    def _start_commands(self) -> list[str]:
        """The host's own commands run in the parent at start, in the setup's round trip (a
        runtime adds its exports): the shell limits itself, and so all it starts."""
        command = self.limits and ulimit_command(self.limits)
        return [command] if command else []

    def _started(self) -> None:
        """Runs once the shell answered (a runtime checks its process tree here)."""

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
        if self._status_fd is not None:
            os.close(self._status_fd)
            self._status_fd = None
        for suffix in STATE_SUFFIXES if self._state_base else ():
            remove_own_file(self._state_base + suffix)
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
                            phase="start", raw=True, rebase="cwd")
        return self.cwd

    def adopt(self, env: Mapping[str, str], limits: Limits | None, cwd: str | None) -> None:
        """Make a shell started ahead of demand look as if it had been started with these:
        variables exported (and kept for restarts), limits set, current directory changed. One
        round trip; without variables the baseline's exports stand and only its directory is
        taken again (no dump subshell)."""
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
                                             phase="start", raw=True, rebase="full" if env else "cwd")
            if state != "marker" or out.status != 0:
                raise SandboxError(f"could not prepare the shell ({state}): {out.text()[-500:]!r}")

    def kill(self) -> None:
        """SIGKILL everything now without waiting; :meth:`close` reaps it later."""
        self._closed = True
        self._killed += self._kill_all()  # no wake: each thread's end of file comes soon enough,
        # and a thousand woken at once would take the GIL from the rest of a bulk kill
        self._killed_all = True

    def close(self) -> None:
        """Kill the shell's whole process group and reap it. Idempotent, safe from any thread."""
        with self._close_lock:
            if self._reaped:
                return
            self._closed = True
            # a kill() before has killed the running command already (its thread lets the lock go)
            killed = self._killed if self._killed_all else self._killed + self._kill_all()
            self._wake()
            # A running command notices _closed at the wake and releases the lock; the fds are
            # closed only under the lock so that no reader ever polls a recycled fd.
            if self._lock.acquire(timeout=10):
                try:
                    killed += self._kill_all()  # again: a restart may have started a new shell
                    self._reap()
                    os.close(self._wake_fd)
                    self._wake_fd = -1
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
            self._wake()

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
        if state == "timeout" or (interrupted and state == "marker"):
            # interrupted: its status may have come before we looked; still a killed command
            why = "interrupted" if interrupted else "timed out"
            if state == "timeout":  # the parent answers once the killed subshell is gone
                state = self._read_until_marker(out, time.monotonic() + KILL_GRACE_S, phase="recover")
            note = f"[command {why}; its processes were killed]"
            if state != "marker":
                note = (f"[command {why}; its processes were killed; the shell did not recover "
                        f"and was restarted in {self._restart()}; exported variables and "
                        f"functions were lost]")
        elif state == "eof":  # the command killed the shell itself: its own status is unknown
            try:
                gone = self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                gone = None
            out.status = None
            note = (f"[the shell exited with status {gone}; a new shell was started in "
                    f"{self._restart()}; exported variables and functions were lost]")
        output, truncated = cut_middle(out.text(), self.output_limit, out.dropped)
        if note:
            output = f"{output}\n{note}" if output else note
        return ExecResult(output=output, exit_code=None if timed_out or interrupted else out.status,
                          timed_out=timed_out, interrupted=interrupted, truncated=truncated)
