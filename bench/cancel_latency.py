"""Time from ``DELETE /jobs/<id>`` to the job's sandbox being gone, for many running rollouts.

Starts the service, puts N rollouts in their run stage (each a shell sandbox running a long
``sleep``), then cancels them one after another while they all run. For each, it measures from
just before the DELETE until (a) the API answered with the typed ``cancelled`` result and (b) the
sandbox's shell process no longer exists.

    python bench/cancel_latency.py [--jobs 100]

Last line: ``cancel_p50_ms=<> cancel_p99_ms=<>`` (time until the sandbox is gone).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.private import REDIS_PASSWORD, REDIS_PORT  # noqa: E402  (sets the environment)

import psutil  # noqa: E402
import requests  # noqa: E402

from prorl_celery.ops.launcher import Stack, StackOptions  # noqa: E402
from sandboxes.base import SandboxHandle  # noqa: E402
from sandboxes.client import RemoteSandbox  # noqa: E402
from sandboxes.procs import alive  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100)
    args = parser.parse_args()
    n = args.jobs
    options = StackOptions(redis_password=REDIS_PASSWORD, state_dir=Path(tempfile.mkdtemp(prefix="bench-cancel-")), beat=False, persist=False,
                           concurrency={"init": 16, "run": n + 8, "eval": 8, "maint": 1},
                           env={"PRORL_SANDBOX_CAPACITY": str(2 * n)})
    stack = Stack(options)
    stack.start_redis(REDIS_PORT)
    http = requests.Session()
    with stack:
        api = stack.api_url
        http.headers["Authorization"] = f"Bearer {stack.api_token}"
        jobs = [{"instance": {"data_source": "shell", "commands": ["sleep 600"], "sandbox": {"runtime": "local"}}}
                for _ in range(n)]
        ids = http.post(f"{api}/jobs", json={"jobs": jobs}, timeout=60).json()["job_ids"]
        deadline = time.monotonic() + 120
        while True:
            views = [http.get(f"{api}/jobs/{i}", timeout=10).json() for i in ids]
            if all(v["status"] == "run" for v in views):
                break
            assert time.monotonic() < deadline, "rollouts did not all reach run"
            time.sleep(0.5)
        time.sleep(1.0)  # every shell is inside its sleep
        answered, gone = [], []
        for job_id in ids:
            from prorl_celery.connections import get_store

            handle = SandboxHandle.model_validate(get_store().get(job_id).sandbox)
            pid = RemoteSandbox(handle).info()["pid"]
            start = time.perf_counter()
            view = http.delete(f"{api}/jobs/{job_id}", timeout=30).json()
            answered.append((time.perf_counter() - start) * 1000)
            assert view["status"] == "cancelled" and view["result"]["critical_error"] == "cancelled"
            while alive(pid):  # gone, or a zombie its reaper has not collected yet
                time.sleep(0.0005)
            gone.append((time.perf_counter() - start) * 1000)
        leftover = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "600"]]
    print(f"rollouts cancelled: {n}; sleep processes left: {len(leftover)}")
    print(f"DELETE answered:  p50 {statistics.median(answered):7.1f} ms  p99 {percentile(answered, 0.99):7.1f} ms")
    print(f"sandbox gone:     p50 {statistics.median(gone):7.1f} ms  p99 {percentile(gone, 0.99):7.1f} ms")
    print(f"cancel_p50_ms={statistics.median(gone):.1f} cancel_p99_ms={percentile(gone, 0.99):.1f}")


if __name__ == "__main__":
    main()
