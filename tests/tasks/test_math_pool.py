"""The math verifier pool on its own: real worker processes, real hostile answers.

Each check has its own deadline from when a worker takes it, runs under a memory and a CPU cap,
and costs nobody else anything when it blows them."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tasks.verify import math_pool
from tasks.verify.math_pool import Limits, Verdict, VerifierPool

HOSTILE = "2^{2^{30}}"  # sympy evaluates it: ~9 s of CPU and ~760 MB when nothing stops it
HUGE = "2^{2^{31}}"  # its value alone is 2^31 bits (256 MB)
OFF = 0  # math-verify's own 5 s alarm off: the caps and the deadline alone, whatever the load


@pytest.fixture
def pools():
    made: list[VerifierPool] = []

    def make(size: int = 2, **limits) -> VerifierPool:
        made.append(VerifierPool(size, Limits(**limits)))
        return made[-1]
    yield make
    for pool in made:
        pool.close()


def _limit(pool: VerifierPool, name: str) -> str:
    """A limit of the pool's idle worker as the kernel holds it (/proc/<pid>/limits)."""
    pid = pool._idle[0].proc.pid
    line = next(l for l in Path(f"/proc/{pid}/limits").read_text().splitlines() if l.startswith(name))
    return line[len(name):].split()[0]


def test_a_check_past_its_deadline_scores_only_itself(pools):
    pool = pools(size=2, timeout_s=2.0, memory_mb=1024, cpu_s=120, library_timeout_s=OFF)
    assert pool.check("1/2", "0.5").verdict is Verdict.EQUAL  # both workers' start is not in the deadline
    out: dict[str, math_pool.Check] = {}
    slow = threading.Thread(target=lambda: out.update(hostile=pool.check(HOSTILE, "1")))
    slow.start()
    honest = [pool.check("\\frac{3}{2}", "1.5") for _ in range(5)]  # the other worker, meanwhile
    slow.join(300)
    assert [c.verdict for c in honest] == [Verdict.EQUAL] * 5
    assert out["hostile"].verdict is Verdict.EXCEEDED and out["hostile"].attempts == 1
    assert 2.0 <= out["hostile"].seconds < 60
    assert pool.check("2", "2").verdict is Verdict.EQUAL  # a fresh worker took the killed one's place


def test_memory_cap_bounds_what_a_check_may_use(pools):
    pool = pools(size=1, timeout_s=300, memory_mb=160, cpu_s=120, library_timeout_s=OFF)
    assert pool.check("1", "1").verdict is Verdict.EQUAL
    assert _limit(pool, "Max address space") == str(160 << 20)
    capped = pool.check(HUGE, "1")
    assert capped.verdict in (Verdict.DIFFERENT, Verdict.EXCEEDED), capped
    if capped.verdict is Verdict.DIFFERENT:  # the worker lived (MemoryError) to say what it used
        assert 0 < capped.peak_kb <= 160 * 1024, capped
    assert pool.check("0.5", "\\frac{1}{2}").verdict is Verdict.EQUAL


def test_cpu_cap_ends_a_check_before_its_deadline(pools):
    pool = pools(size=1, timeout_s=300, memory_mb=1024, cpu_s=1, library_timeout_s=OFF)
    assert pool.check("3", "3").verdict is Verdict.EQUAL
    assert _limit(pool, "Max cpu time") != "unlimited"  # renewed per check: used so far + cpu_s
    check = pool.check(HOSTILE, "1")
    assert check.verdict is Verdict.EXCEEDED and check.attempts == 1 and check.seconds < 300
    assert pool.check("3", "3").verdict is Verdict.EQUAL


def test_a_worker_killed_under_an_honest_check_is_retried(pools, monkeypatch):
    pool = pools(size=1, timeout_s=20, memory_mb=1024, cpu_s=20)
    real_ask = math_pool._Worker.ask
    killed = []

    def ask_after_a_kill(self, given, reference, timeout):
        if not killed:  # the first worker dies from outside just as the check reaches it
            self.proc.kill()
            self.proc.wait()
            killed.append(self.proc.pid)
        return real_ask(self, given, reference, timeout)
    monkeypatch.setattr(math_pool._Worker, "ask", ask_after_a_kill)
    check = pool.check("0.25", "\\frac{1}{4}")
    assert killed and check.verdict is Verdict.EQUAL and check.attempts == 2
