"""One math-verify worker process (run as a script by :mod:`tasks.verify.math_pool`).

``python3 math_worker.py MEMORY_MB CPU_S [LIBRARY_TIMEOUT_S]``: caps its own address space at
``MEMORY_MB`` before importing anything large, says ``{"ready": true}``, then answers one JSON line per check
(``{"given", "reference"}`` -> ``{"equal", "peak_kb"}``) until its input closes. Each check may
use ``CPU_S`` more seconds of CPU: past that the kernel ends the process (SIGXCPU), and only
that check is lost. It runs in this process's main thread, so math-verify's own SIGALRM
timeouts (``LIBRARY_TIMEOUT_S``, default 5; 0: off) work too; they cannot stop work in C (a huge
integer power), which the caps and the pool's deadline do. Standard library and math-verify only.
"""
from __future__ import annotations

import json
import resource
import sys


def _as_math(text: str) -> str:
    text = text.strip()
    return text if text.startswith("$") or "\\boxed" in text else f"${text}$"


def verify(given: str, reference: str, timeout: int | None = 5) -> bool:
    from math_verify import parse, verify as same

    try:
        gold = parse(_as_math(reference), parsing_timeout=timeout)
        answer = parse(_as_math(given), parsing_timeout=timeout)
        return bool(gold) and bool(answer) and bool(same(gold, answer, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - a parser failure is a wrong answer, not a crash
        return given.strip() == reference.strip()


def peak_kb() -> int:
    """This process's peak resident memory (VmHWM), KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _cpu_budget(seconds: int) -> None:
    """The soft CPU limit: what this process used so far plus ``seconds``."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(usage.ru_utime + usage.ru_stime) + 1 + seconds
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def main(argv: list[str]) -> int:
    memory_mb, cpu_s = int(argv[1]), int(argv[2])
    timeout = (int(argv[3]) if len(argv) > 3 else 5) or None
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    verify("1", "1")  # imports math-verify (and sympy) before the first timed check
    print(json.dumps({"ready": True, "peak_kb": peak_kb()}), flush=True)
    for line in sys.stdin:
        check = json.loads(line)
        _cpu_budget(cpu_s)
        equal = verify(str(check["given"]), str(check["reference"]), timeout)
        print(json.dumps({"equal": equal, "peak_kb": peak_kb()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
