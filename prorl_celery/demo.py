"""``up --demo``: submit a handful of diagnostic jobs and show them run, then a summary table."""
from __future__ import annotations

import threading
import time

import requests

DEMO_JOBS = [
    ["echo hello from the sandbox", "pwd", "uname -s"],
    ["mkdir -p work && cd work", "echo 'print(6 * 7)' > answer.py", "python3 answer.py"],
    ["export GREETING=hi", "sleep 1", 'test "$GREETING" = hi'],
    ["ls /definitely/not/here"],
    ["for i in 1 2 3; do echo step $i; sleep 0.3; done"],
    ["git --version || echo 'no git'", "true"],
]


def _submit(http: requests.Session, api: str) -> list[str]:
    jobs = [{"instance": {"data_source": "shell", "commands": cmds, "instance_id": f"demo-{i}"},
             "group_id": "demo"} for i, cmds in enumerate(DEMO_JOBS)]
    resp = http.post(f"{api}/jobs", json={"jobs": jobs}, timeout=30)
    resp.raise_for_status()
    return resp.json()["job_ids"]


def _line(views: list[dict]) -> str:
    counts: dict[str, int] = {}
    for view in views:
        counts[view["status"]] = counts.get(view["status"], 0) + 1
    return "  ".join(f"{status}={n}" for status, n in sorted(counts.items()))


def run_demo(api: str, stop: threading.Event, timeout: float = 120.0, token: str | None = None) -> list[dict]:
    http = requests.Session()
    if token:
        http.headers["Authorization"] = f"Bearer {token}"
    ids = _submit(http, api)
    print(f"demo: submitted {len(ids)} jobs", flush=True)
    deadline, last, views = time.monotonic() + timeout, "", []
    while not stop.is_set() and time.monotonic() < deadline:
        views = [http.get(f"{api}/jobs/{job_id}", timeout=10).json() for job_id in ids]
        line = _line(views)
        if line != last:
            print(f"demo: {line}", flush=True)
            last = line
        if all(view.get("result") for view in views):
            break
        time.sleep(0.2)
    print(_table(views), flush=True)
    return views


def _table(views: list[dict]) -> str:
    rows = [("job", "status", "reward", "steps", "queue_s", "total_s")]
    for view in views:
        result = view.get("result") or {}
        timing = view["timings"]
        rows.append((view["job_id"][:12], view["status"], f"{result.get('reward', 0.0):.1f}",
                     str(len(result.get("steps", []))), f"{timing['queue']:.3f}", f"{timing['total']:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)
