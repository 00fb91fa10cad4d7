"""CPU of a sandbox's whole cycle through the real sandbox host over HTTP: open, ``true``, close.

What a no-op rollout with a sandbox costs beyond one without (init opens the sandbox, run execs a
command, eval closes it): a private Redis and the real host (``Stack``), then per cycle
``open_sandbox(r, SandboxSpec(runtime=...), job)`` -> ``.exec("true")`` -> ``.close()`` from this
process. Per cycle it reports the host's own CPU (its Python: HTTP, the pool, the warm refill,
the kill), the CPU of the host's reaped children (the shells, their subshells, bwrap), this
client's CPU, and the wall time; several rounds, and the load average at the end. To compare
with an older commit, run this same file with that commit's packages first on the path:

    git archive <commit> | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base python3 bench/sandbox_cycle.py --runtime local
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.private import REDIS_PASSWORD, REDIS_PORT  # noqa: E402 - the Redis URL, before the package loads

import psutil  # noqa: E402


def host_cpu(host: psutil.Process) -> tuple[float, float]:
    """(the host's own, its reaped children's) user + system CPU seconds."""
    t = host.cpu_times()
    return t.user + t.system, t.children_user + t.children_system


def run(runtime: str, cycles: int, rounds: int) -> list[dict[str, float]]:
    from prorl_celery.connections import get_redis
    from prorl_celery.ops.launcher import Stack, StackOptions
    from sandboxes.base import SandboxSpec
    from sandboxes.client import open_sandbox

    stack = Stack(StackOptions(state_dir=Path(tempfile.mkdtemp(prefix="sbcycle-")),
                               redis_password=REDIS_PASSWORD,
                               persist=False, redis_url=None, beat=False))
    stack.start_redis(REDIS_PORT)
    try:
        child = stack.start_sandbox_host()
        host = psutil.Process(child.process.pid if hasattr(child, "process") else child.pid)
        client, spec = get_redis(), SandboxSpec(runtime=runtime)

        def cycle(n: int) -> None:
            for _ in range(n):
                sandbox = open_sandbox(client, spec, f"job-{uuid.uuid4().hex[:8]}")
                result = sandbox.exec("true", timeout=10)
                assert result.exit_code == 0, result
                assert sandbox.close()

        cycle(20)  # imports, the warm pool's first fill, the connection
        time.sleep(1.0)
        out = []
        for _ in range(rounds):
            (own0, kids0), me0, wall0 = host_cpu(host), time.process_time(), time.perf_counter()
            cycle(cycles)
            wall1 = time.perf_counter()
            time.sleep(0.5)  # the background teardown and the warm refill of the last cycle
            (own1, kids1), me1 = host_cpu(host), time.process_time()
            per = 1e3 / cycles
            out.append({"host_own": (own1 - own0) * per, "host_children": (kids1 - kids0) * per,
                        "client": (me1 - me0) * per, "wall": (wall1 - wall0) * per})
            print(" ".join(f"{k} {v:.2f}" for k, v in out[-1].items()), "ms/cycle", flush=True)
        return out
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runtime", default="local", help="local (default) or bwrap")
    parser.add_argument("--cycles", type=int, default=300, help="cycles per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = run(args.runtime, args.cycles, args.rounds)
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    total = medians["host_own"] + medians["host_children"]
    print(f"median ({args.runtime}): host {total:.2f} ms/cycle (own {medians['host_own']:.2f}, "
          f"children {medians['host_children']:.2f}), client {medians['client']:.2f}, "
          f"wall {medians['wall']:.2f}")
    print("load average", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
