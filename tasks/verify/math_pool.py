"""The math verifier pool: a few worker processes, each check alone in one, capped and timed.

A hostile answer (``2^{2^{30}}``) can take seconds of CPU and hundreds of MB in sympy. Every
check therefore runs in a worker process (:mod:`tasks.verify.math_worker`) whose address space is
capped (``math_verify_memory_mb``), with a CPU allowance per check (``math_verify_cpu_s``) and a
deadline (``math_verify_timeout_s``) that starts when the worker takes the check, not when it was
queued. A check past its deadline kills its own worker and scores that answer 0: nobody else's
check shares the process, so nobody else's is cancelled. A worker that dies before the deadline
(killed from outside, out of memory) gets its check again on a fresh worker, once; a second
death is that answer's doing and scores it 0. Waiting for a free worker is not charged to the
deadline (the stage's own budget bounds it).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "math_worker.py"
START_TIMEOUT_S = 120.0  # importing sympy on a loaded node


class Verdict(str, Enum):
    EQUAL = "equal"
    DIFFERENT = "different"
    EXCEEDED = "exceeded"  # past its deadline, CPU or memory: the answer scores 0


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 20.0
    memory_mb: int = 1024
    cpu_s: int = 20
    library_timeout_s: int = 5  # math-verify's own alarm inside a check (0: off, the caps alone)


@dataclass
class Check:
    verdict: Verdict
    seconds: float  # from when a worker took it
    peak_kb: int = 0  # the worker's peak resident memory, as the worker saw it
    attempts: int = 1


class _Worker:
    """One worker process and what it has written but we have not yet read."""

    def __init__(self, limits: Limits) -> None:
        flags = ["-P"] if sys.version_info >= (3, 11) else []  # not tasks/verify on its sys.path
        # hostile text goes through sympy (whose parser evaluates): the worker gets none of the
        # service's variables (Redis password, API token), only what finds Python and its packages
        env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
        self.proc = subprocess.Popen([sys.executable, *flags, str(WORKER), str(limits.memory_mb), str(limits.cpu_s),
                                      str(limits.library_timeout_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True, env=env)
        self.buffer = b""
        if self.reply(START_TIMEOUT_S) is None:
            self.kill()
            raise RuntimeError("the math verifier worker did not start")

    def reply(self, timeout: float) -> dict | None:
        """The next line the worker writes, or None if it ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        poller = select.poll()  # not select(): a busy worker's descriptors pass 1024
        poller.register(self.proc.stdout, select.POLLIN)
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def ask(self, given: str, reference: str, timeout: float) -> dict | None:
        try:
            self.proc.stdin.write(json.dumps({"given": given, "reference": reference}).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self.reply(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class VerifierPool:
    """At most ``size`` checks at once, each in a worker of its own (see module doc)."""

    def __init__(self, size: int = 2, limits: Limits = Limits()) -> None:
        self.limits = limits
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def check(self, given: str, reference: str) -> Check:
        with self._slots:
            for attempt in (1, 2):
                worker = self._take()
                started = time.monotonic()
                reply = worker.ask(given, reference, self.limits.timeout_s)
                seconds = time.monotonic() - started
                if reply is not None:
                    self._give(worker)
                    verdict = Verdict.EQUAL if reply.get("equal") else Verdict.DIFFERENT
                    return Check(verdict, seconds, int(reply.get("peak_kb", 0)), attempt)
                worker.kill()
                if seconds >= self.limits.timeout_s or worker.proc.returncode == -signal.SIGXCPU:
                    break  # its own deadline or CPU allowance: this answer's doing
            return Check(Verdict.EXCEEDED, seconds, 0, attempt)

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.proc.poll() is None:
                    return worker
                worker.kill()
        return _Worker(self.limits)

    def _give(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def close(self) -> None:
        """End the idle workers (a check in flight ends its own)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


_pool: VerifierPool | None = None
_pool_lock = threading.Lock()


def shared() -> VerifierPool:
    """This process's pool, sized and capped by the settings (``math_verify_*``)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            from config.settings import get_settings

            s = get_settings()
            _pool = VerifierPool(s.math_verify_workers, Limits(s.math_verify_timeout_s, s.math_verify_memory_mb,
                                                               s.math_verify_cpu_s))
            atexit.register(_pool.close)
        return _pool
