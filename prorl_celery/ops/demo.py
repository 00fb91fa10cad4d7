"""``up --demo``: one job of every built-in domain against the fake LLM, shown live, then a table.

The fake LLM's oracle plays each task (a test and demo tool, not a model): a SWE fixture gets its
bug fixed and its tests run, HumanEval problems get their canonical solutions, math and STEM
questions their answers; two shell jobs show the sandbox on its own (one fails on purpose).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import requests


def demo_jobs(work_dir: Path) -> list[dict]:
    from prorl_celery.fakes import swe
    from prorl_celery.fakes.problems import MATH, STEM

    instances = [
        swe.build("statkit", work_dir),
        {"data_source": "humaneval", "task_id": "HumanEval/0"},
        {"data_source": "humaneval", "task_id": "HumanEval/12"},
        {"data_source": "math", **MATH[0]},
        {"data_source": "math", **MATH[3]},
        {"data_source": "stem", **STEM[0]},
        {"data_source": "shell", "commands": ["echo hello from the sandbox", "pwd", "uname -s"],
         "instance_id": "demo-shell-ok"},
        {"data_source": "shell", "commands": ["ls /definitely/not/here"], "instance_id": "demo-shell-fails"},
    ]
    return [{"instance": inst, "group_id": "demo"} for inst in instances]


def _line(views: list[dict]) -> str:
    counts: dict[str, int] = {}
    for view in views:
        counts[view["status"]] = counts.get(view["status"], 0) + 1
    return "  ".join(f"{status}={n}" for status, n in sorted(counts.items()))


def run_demo(api: str, stop: threading.Event, timeout: float = 300.0, token: str | None = None,
             work_dir: Path | None = None) -> list[dict]:
    http = requests.Session()
    if token:
        http.headers["Authorization"] = f"Bearer {token}"
    work_dir = Path(work_dir or Path.cwd() / "prorl-demo")
    resp = http.post(f"{api}/jobs", json={"jobs": demo_jobs(work_dir)}, timeout=60)
    resp.raise_for_status()
    ids = resp.json()["job_ids"]
    print(f"demo: submitted {len(ids)} jobs (swe, humaneval, math, stem, shell)", flush=True)
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
    print(table(views), flush=True)
    return views


def table(views: list[dict]) -> str:
    rows = [("job", "domain", "status", "reward", "turns", "finish", "queue_s", "total_s")]
    for view in views:
        result = view.get("result") or {}
        timing = view["timings"]
        rows.append((view["job_id"][:12], view["data_source"], view["status"],
                     f"{result.get('reward', 0.0):.2f}", str(result.get("turns", len(result.get("steps", [])))),
                     str(result.get("finish_reason") or "-"), f"{timing['queue']:.3f}", f"{timing['total']:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
