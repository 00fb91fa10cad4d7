"""The audit's time per task and per policy, against issue 34's goal: the whole library on one task
in at most 2x the task's own grading time x the number of policies, the runs in parallel across
the host's sandbox capacity.

    PYTHONPATH=. python3 bench/audit.py --state-dir ~/prorl examples/harbor/hello rows.jsonl ...

On a running stack (``prorl-celery up``, the task folders allowed), for each task, one at a time:
1. the task's own grading time: an oracle's job alone (:func:`grader_agent`), its eval stage
   (``timings.eval``; a Harbor task is graded within the run stage: its steps' ``grade_s``),
   the median of ``--grades`` runs;
2. the library on it: ``tasks.audit.runner.run_audit`` (the no-op, then every policy at once),
   its wall time, and each run's stage times.
It prints a table per task (the grading time, the library's wall, the goal's bound and the ratio
wall / (grading time x policies), goal <= 2) and per policy (its job's init, run, eval and total
seconds, its reward), and with ``--json OUT`` writes everything there."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prorl_celery.client import ProrlClient  # noqa: E402
from tasks.audit import policies, runner, taskset  # noqa: E402

STAGES = ("queue", "init", "run", "eval", "total")


class Recording:
    """The client as the runner sees it, keeping every finished job's view."""

    def __init__(self, client: ProrlClient):
        self.client, self.jobs, self.command_of = client, {}, {}

    def submit_many(self, jobs):
        ids = self.client.submit_many(jobs)
        self.command_of.update({i: j["instance"]["agent"]["command"] for i, j in zip(ids, jobs)})
        return ids

    def cancel(self, job_id):
        return self.client.cancel(job_id)

    def as_completed(self, ids, timeout=None):
        for job in self.client.as_completed(ids, timeout=timeout):
            self.jobs[job["job_id"]] = job
            yield job


def grader_agent(instance: dict[str, Any]) -> dict[str, Any]:
    """The agent whose job's eval is the task's full grading: the oracle (a Harbor task's solve.sh,
    a SWE row's gold patch replayed: an empty patch is scored without running the tests), else the
    no-op."""
    if instance.get("data_source") == "harbor":
        return {"harness": "oracle"}
    if instance.get("patch"):
        return {"harness": "replay", "patch": instance["patch"]}
    return policies.NOOP.agent()


def grading_time(client: ProrlClient, task: taskset.AuditTask, runs: int, timeout: float) -> dict[str, Any]:
    """The oracle's (or no-op's) job alone, ``runs`` times: its eval stage's seconds (median) and
    every timing."""
    seen = []
    for _ in range(runs):
        job = client.wait(client.submit({**task.instance, "agent": grader_agent(task.instance)}), timeout=timeout)
        result = job.get("result") or {}
        steps = (result.get("harbor") or {}).get("steps") or []
        graded = sum(float(st.get("grade_s") or st.get("test_s") or 0.0) for st in steps)  # within the run stage
        seen.append({**{k: round(float((job.get("timings") or {}).get(k) or 0.0), 3) for k in STAGES},
                     "grade": round(graded if steps else float((job.get("timings") or {}).get("eval") or 0.0), 3),
                     "reward": result.get("reward")})
    return {"eval_s": statistics.median(t["grade"] for t in seen), "runs": seen}


def library_on(client: ProrlClient, task: taskset.AuditTask, chosen: list[policies.Policy],
               timeout: float) -> dict[str, Any]:
    rec = Recording(client)
    started = time.monotonic()
    (verdict,) = runner.run_audit(rec, [task], chosen, timeout=timeout)
    wall = time.monotonic() - started
    per_policy = {}
    by_script = {p.agent()["command"]: p.name for p in [policies.NOOP, *chosen]}
    for job_id, job in rec.jobs.items():
        name = by_script.get(rec.command_of.get(job_id))
        ev = next((e for e in verdict.evidence if e.policy == name), None)
        per_policy[name or job["job_id"]] = {
            **{k: round(float((job.get("timings") or {}).get(k) or 0.0), 3) for k in STAGES},
            "status": job.get("status"), "reward": ev.reward if ev else None}
    return {"wall_s": round(wall, 2), "hackable": verdict.hackable, "policies_earned": verdict.policies,
            "per_policy": per_policy, "note": verdict.note}


def capacity(client: ProrlClient) -> dict[str, Any]:
    """The hosts' sandbox capacity and the stage workers' threads (the runs' parallelism)."""
    health = client.health()
    return {"sandbox_capacity": sum(int(h.get("capacity") or 0) for h in health.get("sandbox_hosts") or []),
            "worker_threads": {q: sum(w.values()) for q, w in (health.get("worker_threads") or {}).items()},
            "load_avg": os.getloadavg(), "cpus": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--state-dir", default=os.environ.get("PRORL_STATE_DIR"))
    ap.add_argument("--policies", default=None)
    ap.add_argument("--grades", type=int, default=1, help="no-op runs alone per task for its grading time")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    from prorl_celery.ops.cli import _load_secrets

    _load_secrets(args.state_dir)
    client = ProrlClient(None, state_dir=args.state_dir)
    chosen = policies.select([n for n in args.policies.split(",") if n] if args.policies else None)
    host = capacity(client)
    print(f"sandbox capacity {host['sandbox_capacity']}, stage threads {host['worker_threads']}, "
          f"load {host['load_avg']}", flush=True)
    report = {"policies": len(chosen), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": host,
              "tasks": []}
    print(f"{'task':28} {'grade s':>8} {'library wall s':>15} {'goal <= s':>10} {'wall/(grade*n)':>15} hackable")
    for task in taskset.load(args.paths):
        grade = grading_time(client, task, args.grades, args.timeout)
        lib = library_on(client, task, chosen, args.timeout)
        bound = 2 * grade["eval_s"] * len(chosen)
        ratio = lib["wall_s"] / (grade["eval_s"] * len(chosen)) if grade["eval_s"] else float("inf")
        row = {"task": task.name, "data_source": task.instance["data_source"], "grade": grade, "library": lib,
               "goal_bound_s": round(bound, 1), "ratio": round(ratio, 2), "load_avg": os.getloadavg()}
        report["tasks"].append(row)
        print(f"{task.name:28} {grade['eval_s']:8.1f} {lib['wall_s']:15.1f} {bound:10.1f} {ratio:15.2f} "
              f"{lib['hackable']}", flush=True)
        for name, t in sorted(lib["per_policy"].items(), key=lambda kv: -kv[1]["total"]):
            print(f"    {name:22} init {t['init']:6.1f}  run {t['run']:6.1f}  eval {t['eval']:6.1f}  "
                  f"total {t['total']:6.1f}  {t['status']} reward {t.get('reward')}", flush=True)
    report["host"]["load_avg_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
