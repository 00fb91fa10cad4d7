"""CPU of a sandbox's life in-process: create, ``true`` (or more commands), close, N times.

Counts this process's CPU (the runtime's Python side) and its reaped children's (the shell, the
subshells it forked, bwrap and the start's helpers), per cycle. No HTTP, no host: the cost of the
runtime alone, which the load of other work disturbs less than wall time. To compare with an
older commit, run the same command with that commit's packages first on the path:

    git archive <commit> sandboxes config prorl_celery | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python bench/sandbox_cycle_cpu.py --runtime local
"""
from __future__ import annotations

import argparse
import os
import resource
import time

from sandboxes.base import SandboxSpec
from sandboxes.registry import load_runtime


def cpu_s() -> tuple[float, float]:
    """(this process, its reaped children) user + system CPU seconds."""
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def cycle(cls: type, spec: SandboxSpec, job_id: str, commands: int) -> None:
    sandbox = cls(spec, job_id)
    try:
        for _ in range(commands):
            result = sandbox.exec("true")
            assert result.exit_code == 0, result
    finally:
        sandbox.close()


def measure(runtime: str, cycles: int, commands: int) -> dict[str, float]:
    cls, spec = load_runtime(runtime), SandboxSpec(runtime=runtime)
    for i in range(5):  # the guardian, the execute-only bash, the workspace image, imports
        cycle(cls, spec, f"warm-{i}", 1)
    time.sleep(1.0)
    (own0, kids0), started = cpu_s(), time.monotonic()
    for i in range(cycles):
        cycle(cls, spec, f"cycle-{i}", commands)
    time.sleep(2.0)  # background reaping and workspace removal finish
    own1, kids1 = cpu_s()
    per = 1e3 / cycles
    return {"host_ms": (own1 - own0) * per, "children_ms": (kids1 - kids0) * per,
            "total_ms": (own1 - own0 + kids1 - kids0) * per,
            "wall_ms": (time.monotonic() - started - 2.0) * per, "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", default="local")
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--commands", type=int, default=1, help="`true`s per sandbox")
    args = parser.parse_args()
    figures = measure(args.runtime, args.cycles, args.commands)
    print(f"sandbox_cycle runtime={args.runtime} cycles={args.cycles} commands={args.commands} "
          + " ".join(f"{key}={value:.2f}" for key, value in figures.items()))


if __name__ == "__main__":
    main()
