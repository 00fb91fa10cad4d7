"""A long-running command of the README (``up``, a worker, the API), started as a user starts it,
with its output collected as it comes."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path


class Running:
    """``bash -c <line>`` in the background; ``expect`` waits for a line of its output."""

    def __init__(self, line: str, env: dict[str, str], cwd: Path, prefix: list[str] = ()):
        self.line = line
        self.proc = subprocess.Popen([*prefix, "bash", "-c", line], env=env, cwd=cwd, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def expect(self, needle: str, timeout: float) -> str:
        """The first output line holding ``needle``; AssertionError (with the output) if the
        command exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next((line for line in list(self.lines) if needle in line), None)
            if hit:
                return hit
            if self.proc.poll() is not None:
                self._reader.join(5)
                hit = next((line for line in self.lines if needle in line), None)
                if hit:
                    return hit
                raise AssertionError(f"{self.line!r} exited {self.proc.returncode} before "
                                     f"printing {needle!r}:\n{self.output}")
            time.sleep(0.1)
        raise AssertionError(f"{self.line!r} printed no {needle!r} within {timeout}s:\n{self.output}")

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM to the command (it stops what it started), then SIGKILL to its whole group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)
        self._reader.join(5)
        return self.proc.returncode
