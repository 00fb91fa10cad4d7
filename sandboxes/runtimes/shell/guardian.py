"""One watcher process per host that kills every sandbox still open when the host dies.

``PR_SET_PDEATHSIG`` reaches only the process it is set on: a shell wrapped in ``setpriv
--pdeathsig`` dies with a ``kill -9`` of the host, but the command it was running does not, and
the wrapper's exec costs about 0.9 ms of CPU per sandbox. Instead the host starts one guardian, in
its own session, and tells it through a pipe which shells it holds. Only the host has the pipe's
write end (Python makes pipes non-inheritable), so when the host dies, however it dies, the
guardian reads end of file and kills what is still on its list: each shell's descendants
(stopped first, so a fork loop cannot outrun the walk), the shell, and its process group.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

from sandboxes.runtimes.procs import kill_descendants, kill_pids

log = logging.getLogger(__name__)


def main() -> None:
    """The guardian process (``python -m sandboxes.runtimes.shell.guardian``): note ``+ <pid>`` and ``- <pid>``
    lines until end of file, then kill every shell still held, with its whole tree."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a Ctrl-C meant for the host must not disarm it
    held: set[int] = set()
    for line in sys.stdin:
        op, _, pid = line.strip().partition(" ")
        if pid.isdigit():
            (held.add if op == "+" else held.discard)(int(pid))
    for root in held:
        kill_descendants(root)
        kill_pids([root])
        try:
            os.killpg(root, signal.SIGKILL)
        except OSError:
            pass


class Guardian:
    """The host side: :meth:`hold` a shell's pid once it runs, :meth:`drop` it once reaped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._proc: subprocess.Popen | None = None

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "sandboxes.runtimes.shell.guardian"], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                bufsize=0)
            if self._held:  # a guardian that died is replaced with the whole list
                self._proc.stdin.write("".join(f"+ {pid}\n" for pid in self._held).encode())
        return self._proc

    def _send(self, line: str) -> None:
        for attempt in (1, 2):
            try:
                self._ensure().stdin.write(line.encode())
                return
            except OSError as exc:
                if attempt == 2:
                    log.error("sandbox guardian unavailable (%s); shells may outlive a crash of this host", exc)
                self._proc = None

    def hold(self, pid: int) -> None:
        with self._lock:
            self._held.add(pid)
            self._send(f"+ {pid}\n")

    def drop(self, pid: int) -> None:
        with self._lock:
            if pid in self._held:
                self._held.discard(pid)
                self._send(f"- {pid}\n")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None


_guardians: dict[int, Guardian] = {}
_guardians_lock = threading.Lock()


def guardian() -> Guardian:
    """This process's guardian (a forked child gets its own; its parent's pipe is not its)."""
    with _guardians_lock:
        found = _guardians.get(os.getpid())
        if found is None:
            found = _guardians[os.getpid()] = Guardian()
        return found


if __name__ == "__main__":
    main()
