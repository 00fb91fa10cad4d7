"""Service parts as child processes that die with their parent and are stopped as a whole process group."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from prorl_celery.spawn import die_with_parent, spawn

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Child:
    """One supervised process: own session, output to a log file, stopped by process group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path):
        self.name, self.argv, self.env = name, argv, env
        self.log_path = log_dir / f"{name}.log"
        self.popen: subprocess.Popen | None = None

    def start(self) -> "Child":
        log = open(self.log_path, "ab")
        self.popen = spawn(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                           stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group, then SIGKILL whatever is left after ``grace_s``."""
        if self.popen is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.signal(signal.SIGKILL)  # also reaps stragglers of the group once the leader exited
        self.popen.wait()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_for(predicate, timeout: float, what: str, pause: float = 0.1, child: Child | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if child is not None and not child.alive():
            raise RuntimeError(f"{child.name} exited while waiting for {what}:\n{child.tail()}")
        time.sleep(pause)
    tail = f"\n{child.tail()}" if child else ""
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{tail}")
