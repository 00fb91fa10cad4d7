"""The command channel of :class:`sandboxes.runtimes.shell.persistent.PersistentShell`: one line to the
parent, its output read from stdout until the status line with the line's token arrives on
the status pipe (a line with another token is stale or injected, and ignored)."""
from __future__ import annotations

import os
import secrets
import subprocess
import threading
import time

from sandboxes.runtimes.shell.output import Output
from sandboxes.runtimes.procs import readable
from sandboxes.runtimes.shell.script import REBASES, shell_quote

_READ_CHUNK = 1 << 16


class ShellChannel:
    """The round trip of one line; :class:`~sandboxes.runtimes.shell.persistent.PersistentShell` starts the
    process and sets the pipes this reads (``_fd``: stdout, ``_status_fd``/``_status_w``: the
    status pipe's ends)."""

    output_limit: int
    cwd: str
    _proc: subprocess.Popen | None
    _fd: int
    _status_fd: int | None
    _status_w: int
    _status_buf: bytes
    _token: bytes
    _closed: bool
    _interrupted: threading.Event
    _wake_fd: int  # an eventfd: close and interrupt write it, so a waiting read returns

    def _wake(self) -> None:
        """Make a thread waiting in :meth:`_read_until_marker` look at ``_closed`` and
        ``_interrupted`` now (it sleeps until output, its status, its deadline or this)."""
        try:
            os.eventfd_write(self._wake_fd, 1)
        except (OSError, ValueError):
            pass  # closed: nobody waits any more

    def _kill_command(self) -> list[int]:
        raise NotImplementedError

    def _roundtrip(self, command: str, deadline: float, phase: str = "command", raw: bool = False,
                   info: str = '"$PWD"', rebase: str = "full") -> tuple[Output, str]:
        """Send ``command`` and read until its status arrives. ``raw``: the parent itself runs it
        (the host's own setup commands only), then rebases: ``"full"`` (a subshell dumps the
        baseline anew: the command may have exported), ``"cwd"`` (only the directory is taken,
        no fork: a command that exports nothing and sets no option, such as ``cd`` or ``ulimit``)
        or ``""`` (none: the start, whose init does it); otherwise a subshell runs it, as
        described above."""
        out = Output(self.output_limit)
        fd, token = self._status_w, secrets.token_hex(6)
        self._token = token.encode()  # a line with another token is stale or injected: ignored
        if raw:
            then = f'builtin eval "${REBASES[rebase]}"; ' if rebase else ""
            line = (f"{command}\n__prorl_s=$?; {then}"
                    f"builtin printf '{token} %d %s\\n' \"$__prorl_s\" {info} >&{fd}\n")
        else:
            line = f"__prorl_t={token} __prorl_k={shell_quote(command)}; builtin eval \"$__prorl_R\"\n"
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
        """Read output into ``out`` until the status line arrives on the status pipe; returns
        "marker", "eof" or "timeout" (also on close, and on interrupt while a command runs).
        ``phase``: "command", "recover" (keep killing) or "start"."""
        stop_on_interrupt, kill_each_poll = phase == "command", phase == "recover"
        while True:
            if self._status_line(out):
                self._drain(out)  # all the subshell wrote before it exited is in the pipe now
                if out.pwd:
                    self.cwd = out.pwd
                return "marker"
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed or (stop_on_interrupt and self._interrupted.is_set()):
                return "timeout"
            if kill_each_poll:  # a fork loop may have spawned more since the last kill
                self._kill_command()
            try:
                # no periodic wake-up: a thousand waiting commands would cost the host CPU and
                # GIL hand-offs 20 times a second each (a kill loop then waits behind them)
                ready = readable((self._fd, self._status_fd, self._wake_fd),
                                 min(remaining, 0.05) if kill_each_poll else remaining)
                if self._wake_fd in ready:
                    _drain_eventfd(self._wake_fd)
                if self._status_fd in ready:
                    status = os.read(self._status_fd, 4096)
                    if status == b"":
                        return "eof"
                    self._status_buf += status
                chunk = os.read(self._fd, _READ_CHUNK) if self._fd in ready else None
            except (OSError, ValueError, TypeError):
                chunk = b""
            if chunk == b"":
                return "eof"
            if chunk:
                out.add(chunk)

    def _status_line(self, out: Output) -> bool:
        while True:
            line, found, rest = self._status_buf.partition(b"\n")
            if not found:
                return False
            self._status_buf = rest
            token, _, line = line.partition(b" ")
            if token == self._token:
                break
        status, _, pwd = line.decode(errors="replace").partition(" ")
        out.status, out.pwd = (int(status) if status.lstrip("-").isdigit() else None), pwd or None
        return True

    def _drain(self, out: Output) -> None:
        while True:
            try:
                ready = readable((self._fd,), 0)
                chunk = os.read(self._fd, _READ_CHUNK) if ready else b""
            except (OSError, ValueError):
                return
            if not chunk:
                return
            out.add(chunk)


def _drain_eventfd(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass  # another waiter (a restart's recover read) took it first
