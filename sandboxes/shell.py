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
import secrets
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import psutil

from prorl_celery.errors import SandboxError, SandboxGone
from sandboxes.base import ExecResult

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
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shell-spawner")


def die_with_parent() -> None:
    """preexec: SIGKILL this child when the thread that spawned it dies (a kill -9 of the host)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(*args, **kwargs) -> subprocess.Popen:
    """Popen from one thread that lives as long as the process: PR_SET_PDEATHSIG fires when the
    forking *thread* exits, so a shell forked by a short-lived request thread would die with it."""
    return _spawner.submit(subprocess.Popen, *args, **kwargs).result()


def shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def kill_descendants(pid: int) -> list[psutil.Process]:
    """SIGKILL every descendant of ``pid`` (not ``pid`` itself); returns those signalled."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    return children


def wait_dead(procs: list[psutil.Process], timeout: float) -> bool:
    """Wait until killed orphans are gone; a zombie counts as dead (its reaper is init, not us)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for proc in procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                pass
        if not alive or time.monotonic() >= deadline:
            return not alive
        procs = alive
        time.sleep(0.005)


def cut_middle(text: str, limit: int, extra_cut: int = 0) -> tuple[str, bool]:
    """Keep head and tail of ``text`` within ``limit`` chars; ``extra_cut`` counts chars already dropped."""
    if len(text) <= limit and not extra_cut:
        return text, False
    if len(text) <= limit:
        head, tail = text[: len(text) // 2], text[len(text) // 2:]
        cut = extra_cut
    else:
        head, tail = text[: limit // 2], text[len(text) - (limit - limit // 2):]
        cut = len(text) - limit + extra_cut
    return f"{head}\n[... {cut} chars cut ...]\n{tail}", True


class _Output:
    """Bytes read for one command; keeps only head and tail once it grows past what could be shown."""

    def __init__(self, limit_chars: int, marker: bytes):
        self._keep = max(4 * limit_chars, 4096) + len(marker) + 8192  # 4 bytes/char worst case; $PWD
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.status: int | None = None
        self.pwd: str | None = None
        self._marker = marker
        self._marker_at: int | None = None
        self._scan_from = 0

    def add(self, data: bytes) -> None:
        self.tail += data
        if len(self.tail) > 4 * self._keep:  # amortised: compact rarely
            if not self.head:
                self.head = self.tail[: self._keep]
                del self.tail[: self._keep]
            drop = len(self.tail) - self._keep
            self.dropped += drop
            del self.tail[:drop]
            self._scan_from = 0

    def parse_marker(self) -> bool:
        """True once the complete marker line arrived; sets ``status`` and ``pwd``."""
        start = self.tail.find(self._marker, max(0, self._scan_from - len(self._marker)))
        if start < 0:
            self._scan_from = len(self.tail)
            return False
        end = self.tail.find(b"\n", start + len(self._marker))
        if end < 0:
            return False
        status, _, pwd = self.tail[start + len(self._marker): end].decode(errors="replace").partition(" ")
        self.status, self.pwd, self._marker_at = int(status), pwd or None, start
        return True

    def text(self) -> str:
        tail = self.tail if self._marker_at is None else self.tail[: self._marker_at]
        return (self.head + tail).decode("utf-8", errors="replace")


class PersistentShell:
    """A bash process that runs one command at a time, keeping cwd and environment between them."""

    def __init__(self, argv: Sequence[str] = DEFAULT_ARGV, cwd: str | None = None,
                 env: Mapping[str, str] | None = None, *, output_limit: int | None = None,
                 preexec_fn: Callable[[], None] | None = None, default_timeout: float | None = None):
        """``env``: the shell's environment, the non-interactive defaults filling what it lacks;
        None: this process's environment, overridden by those defaults."""
        from config.settings import get_settings

        settings = get_settings()
        self.argv = list(argv)
        self.initial_cwd = cwd or os.getcwd()
        self.cwd = self.initial_cwd
        self.env = ({**os.environ, **NONINTERACTIVE_ENV} if env is None
                    else {**NONINTERACTIVE_ENV, **env})
        self.output_limit = output_limit or settings.output_limit_chars
        self.default_timeout = default_timeout or settings.action_timeout_s
        self._preexec_fn = preexec_fn
        self._nonce = secrets.token_hex(12)
        self._marker = f"\n{self._nonce} ".encode()
        self._lock = threading.Lock()
        self._interrupted = threading.Event()
        self._running = False
        self._closed = False
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._start(self.initial_cwd)

    # -- process lifecycle -------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def closed(self) -> bool:
        return self._closed

    def _preexec(self) -> None:
        die_with_parent()
        if self._preexec_fn:
            self._preexec_fn()

    def _start(self, cwd: str) -> None:
        self._proc = spawn(
            self.argv, cwd=cwd, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=self._preexec, bufsize=0)
        self._fd = self._proc.stdout.fileno()
        out, state = self._roundtrip(":", time.monotonic() + START_TIMEOUT_S, phase="start")
        if state != "marker":
            self._signal_all()
            self._reap()
            raise SandboxError(f"shell {self.argv!r} did not start ({state}): {out.text()[-2000:]!r}")

    def _signal_all(self) -> list[psutil.Process]:
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

    def _restart(self) -> str:
        self._signal_all()
        self._reap()
        cwd = self.cwd if os.path.isdir(self.cwd) else self.initial_cwd
        self.restarts += 1
        self._start(cwd)
        return cwd

    def close(self) -> None:
        """Kill the shell's whole process group and reap it. Idempotent, safe from any thread."""
        if self._closed:
            return
        self._closed = True
        killed = self._signal_all()
        # A running command notices _closed within one poll and releases the lock; the fds are
        # closed only under the lock so that no reader ever selects on a recycled fd number.
        if self._lock.acquire(timeout=10):
            try:
                killed += self._signal_all()  # again: a restart may have started a new shell
                self._reap()
            finally:
                self._lock.release()
        wait_dead(killed, timeout=2)

    # -- commands ----------------------------------------------------------------------------

    def interrupt(self) -> None:
        """Kill the running command's processes; :meth:`run` returns with ``interrupted=True``."""
        if self._running and self._proc:
            self._interrupted.set()
            kill_descendants(self._proc.pid)

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

    def _roundtrip(self, command: str, deadline: float, phase: str = "command") -> tuple[_Output, str]:
        out = _Output(self.output_limit, self._marker)
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

    def _read_until_marker(self, out: _Output, deadline: float, phase: str = "command") -> str:
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
                kill_descendants(self._proc.pid)
            try:
                ready, _, _ = select.select([self._fd], [], [], min(remaining, 0.05))
                chunk = os.read(self._fd, _READ_CHUNK) if ready else None
            except (OSError, ValueError):
                chunk = b""
            if chunk == b"":
                return "eof"
            if chunk:
                out.add(chunk)
