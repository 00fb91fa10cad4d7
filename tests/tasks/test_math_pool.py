"""The math verifier pool on its own: real worker processes, real hostile answers.

Each check has its own deadline from when a worker takes it, runs under a memory and a CPU cap,
and costs nobody else anything when it blows them."""
from __future__ import annotations

import threading

import pytest

from tasks.verify import math_pool
from tasks.verify.math_pool import Limits, Verdict, VerifierPool

HOSTILE = "2^{2^{30}}"  # ~440 MB and seconds of sympy when nothing caps it


@pytest.fixture
def pools():
    made: list[VerifierPool] = []

    def make(size: int = 2, **limits) -> VerifierPool:
        made.append(VerifierPool(size, Limits(**limits)))
        return made[-1]
    yield make
    for pool in made:
        pool.close()


def test_a_check_past_its_deadline_scores_only_itself(pools):
    pool = pools(size=2, timeout_s=2.0, memory_mb=1024, cpu_s=60)
    assert pool.check("1/2", "0.5").verdict is Verdict.EQUAL  # both workers' start is not in the deadline
    out: dict[str, math_pool.Check] = {}
    slow = threading.Thread(target=lambda: out.update(hostile=pool.check(HOSTILE, "1")))
    slow.start()
    honest = [pool.check("\\frac{3}{2}", "1.5") for _ in range(5)]  # the other worker, meanwhile
    slow.join(120)
    assert [c.verdict for c in honest] == [Verdict.EQUAL] * 5
    assert out["hostile"].verdict is Verdict.EXCEEDED and out["hostile"].attempts == 1
    assert 2.0 <= out["hostile"].seconds < 30
    assert pool.check("2", "2").verdict is Verdict.EQUAL  # a fresh worker took the killed one's place


def test_memory_cap_bounds_what_a_check_may_use(pools):
    capped = pools(size=1, timeout_s=60, memory_mb=160, cpu_s=60).check(HOSTILE, "1")
    assert capped.verdict in (Verdict.DIFFERENT, Verdict.EXCEEDED)
    if capped.verdict is Verdict.DIFFERENT:  # the worker lived to say how much it used
        assert 0 < capped.peak_kb <= 160 * 1024, capped
    uncapped = pools(size=1, timeout_s=60, memory_mb=4096, cpu_s=60).check(HOSTILE, "1")
    assert uncapped.peak_kb > 160 * 1024, uncapped  # so the cap, not the answer, bounded the first


def test_cpu_cap_ends_a_check_before_its_deadline(pools):
    pool = pools(size=1, timeout_s=120, memory_mb=1024, cpu_s=1)
    check = pool.check("10^{10^{8}} - 10^{10^{8}-1}", "9")
    assert check.verdict is Verdict.EXCEEDED and check.attempts == 1 and check.seconds < 120
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
