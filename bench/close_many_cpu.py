"""Host CPU of one bulk close: ``SandboxPool.close_many`` of N bwrap sandboxes, each running
``sleep 100``, in this process (process time around the call; teardown runs after it).

    PYTHONPATH=<tree> python3 bench/close_many_cpu.py 100

Run it for two trees side by side (``git archive REV | tar -x -C DIR``) to compare a change.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time

from sandboxes.base import SandboxSpec
from sandboxes.host.pool import SandboxPool


def _busy(pool: SandboxPool, sandbox_id: str) -> None:
    try:
        pool.exec(sandbox_id, "sleep 100", 200)
    except Exception:  # noqa: BLE001 - closed under it: what the bench does
        pass


def main(n: int) -> None:
    root = tempfile.mkdtemp(prefix="close-many-")
    os.chmod(root, 0o711)  # reachable for the sandboxes' own uids when run as root
    pool = SandboxPool("bench", n + 1, 60, runtime_config={"bwrap": {"root": root}})
    ids = [pool.create(f"j{i}", SandboxSpec(runtime="bwrap")).sandbox_id for i in range(n)]
    threads = [threading.Thread(target=_busy, args=(pool, i), daemon=True) for i in ids]
    for thread in threads:
        thread.start()
    time.sleep(2)
    cpu, wall = time.process_time(), time.monotonic()
    closed = pool.close_many(ids)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    for thread in threads:
        thread.join(10)
    pool.drain(60)
    print(f"closed {len(closed)}: cpu {1000 * cpu:.1f} ms, wall {1000 * wall:.1f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
