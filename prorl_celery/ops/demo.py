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


class DemoFailed(RuntimeError):
    """The demo could not run or a job of it did not complete: one line says why."""


def _refusal(resp: requests.Response) -> str:
    try:
        error = resp.json()["error"]
        return f"{resp.status_code} {error['type']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{resp.status_code} {resp.text[:200]}"


def run_demo(api: str, stop: threading.Event, timeout: float = 300.0, token: str | None = None,
             work_dir: Path | None = None) -> list[dict]:
    """Submit the demo batch, print its progress and the table; raise :class:`DemoFailed` when
    the API refuses it, a job does not end within ``timeout`` or ends other than ``completed``."""
    http = requests.Session()
    if token:
        http.headers["Authorization"] = f"Bearer {token}"
    work_dir = Path(work_dir or Path.cwd() / "prorl-demo")
    try:
        resp = http.post(f"{api}/jobs", json={"jobs": demo_jobs(work_dir)}, timeout=60)
        if resp.status_code != 202:
            raise DemoFailed(f"the API refused the demo batch: {_refusal(resp)}")
        ids = resp.json()["job_ids"]
        print(f"demo: submitted {len(ids)} jobs (swe, humaneval, math, stem, shell)", flush=True)
        views = _follow(http, api, ids, stop, timeout)
    except requests.RequestException as exc:
        raise DemoFailed(f"the API did not answer: {type(exc).__name__}: {exc}") from None
    print(table(views), flush=True)
    unfinished = [v for v in views if v.get("status") != "completed"]
    if unfinished and not stop.is_set():
        raise DemoFailed(f"{len(unfinished)} of {len(views)} jobs did not complete: " + ", ".join(
            f"{v['data_source']} {v.get('status')}" for v in unfinished))
    return views


def _follow(http: requests.Session, api: str, ids: list[str], stop: threading.Event,
            timeout: float) -> list[dict]:
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
