"""``prorl-celery harbor``: Harbor task folders as a dataset.

``submit DIR...`` submits a group of ``--n`` samples per task (a DIR is a task folder, or a folder
of task folders) with the chosen agent, shows a progress bar while they run, and prints a table of
rewards per task at the end (``--json`` for the rows). Before it, the tasks the hack audit has no
current verdict on are audited (``prorl-celery audit``; ``--no-audit`` skips it, and the oracle
needs none), and a task the service then refuses as hackable is left out and said so. ``check DIR...`` reads each task here, as
the service will, and says what it would run or which key it refuses.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

BUILTIN = "builtin"


def task_dirs(paths: list[str]) -> list[Path]:
    """Each path that is a task folder (holds task.toml), or the task folders directly in it, sorted."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw).resolve()
        if (path / "task.toml").is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(p for p in path.iterdir() if (p / "task.toml").is_file())
        else:
            raise SystemExit(f"harbor: {raw} is neither a task folder nor a folder of them")
    if not found:
        raise SystemExit(f"harbor: no task.toml in {' '.join(paths)}")
    return found


def agent_block(agent: str) -> dict[str, Any] | None:
    """``--agent``: builtin (the service's own agent), a harness name, or a JSON agent block."""
    if agent == BUILTIN:
        return None
    if agent.lstrip().startswith("{"):
        block = json.loads(agent)
        if not isinstance(block, dict):
            raise SystemExit("harbor: --agent JSON must be an object")
        return block
    return {"harness": agent}


def instance(task: Path, agent: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"data_source": "harbor", "task_dir": str(task)}
    if agent is not None:
        body["agent"] = agent
    return body


def bar(done: int, total: int, rewards: list[float], started: float, out: TextIO) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
    out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} done  mean reward {mean}  "
              f"{time.monotonic() - started:.0f}s")
    out.flush()


def summarize(task: str, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of the table: a task's samples."""
    results = [j.get("result") or {} for j in jobs]
    rewards = [float(r.get("reward") or 0.0) for r in results]
    named: dict[str, list[float]] = {}
    for r in results:
        for key, value in ((r.get("harbor") or {}).get("rewards") or {}).items():
            named.setdefault(key, []).append(value)
    errors: dict[str, int] = {}
    for j, r in zip(jobs, results):
        if j.get("status") != "completed":
            kind = (r.get("error") or {}).get("type") or j.get("status") or "unknown"
            errors[kind] = errors.get(kind, 0) + 1
    return {"task": task, "n": len(jobs), "mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "solved": sum(1 for x in rewards if x >= 1.0), "rewards": {k: sum(v) / len(v) for k, v in named.items()},
            "errors": errors}


def table(rows: list[dict[str, Any]]) -> str:
    head = ["task", "n", "mean reward", "solved", "named rewards (mean)", "errors"]
    body = [[r["task"], str(r["n"]), f"{r['mean']:.3f}", f"{r['solved']}/{r['n']}",
             " ".join(f"{k}={v:.2f}" for k, v in sorted(r["rewards"].items())) or "-",
             " ".join(f"{k}:{v}" for k, v in sorted(r["errors"].items())) or "-"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def _audit_first(client: Any, tasks: list[Path], timeout: float | None) -> None:
    """Audit the tasks without a current verdict (a dataset's first training submission), store
    the verdicts, and print their table to stderr."""
    from prorl_celery.ops import audit_cli
    from tasks.audit import quarantine

    known = {v["content_hash"] for v in client.audit()["verdicts"] if v.get("current")}
    todo = [t for t in tasks if quarantine.content_hash(instance(t, None)) not in known]
    if not todo:
        return
    print(f"harbor: auditing {len(todo)} task(s) with the hack policies first (--no-audit skips it)", file=sys.stderr)
    verdicts = audit_cli.audit(client, [str(t) for t in todo], None, timeout)
    audit_cli.store(verdicts)
    print(audit_cli.table(verdicts), file=sys.stderr)


def _cmd_submit(args: argparse.Namespace) -> int:
    from prorl_celery.client import ProrlClient
    from prorl_celery.errors import TaskQuarantined
    from prorl_celery.ops.cli import _load_secrets

    _load_secrets(args.state_dir)
    client = ProrlClient(args.url, state_dir=args.state_dir)
    agent = agent_block(args.agent)
    sampling = json.loads(args.sampling) if args.sampling else {}
    tasks = task_dirs(args.dirs)
    if not args.no_audit and (agent or {}).get("harness") != "oracle":
        _audit_first(client, tasks, args.timeout)
    groups: dict[str, tuple[str, list[str]]] = {}
    for task in tasks:
        try:
            groups[task.name] = client.submit_group(instance(task, agent), args.n, sampling)
        except TaskQuarantined as exc:
            print(f"harbor: {task.name} left out: {exc}", file=sys.stderr)
    if not groups:
        return 1
    owner = {job: name for name, (_, jobs) in groups.items() for job in jobs}
    finished: dict[str, list[dict[str, Any]]] = {name: [] for name in groups}
    rewards: list[float] = []
    started, out = time.monotonic(), sys.stderr
    bar(0, len(owner), rewards, started, out)
    try:
        for job in client.as_completed(list(owner), timeout=args.timeout):
            finished[owner[job["job_id"]]].append(job)
            rewards.append(float((job.get("result") or {}).get("reward") or 0.0))
            bar(sum(map(len, finished.values())), len(owner), rewards, started, out)
    except KeyboardInterrupt:
        out.write("\ncancelling...\n")
        for group, _ in groups.values():
            client.cancel_group(group)
        return 130
    out.write("\n")
    rows = [summarize(name, jobs) for name, jobs in finished.items()]
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from prorl_celery.errors import ProrlError
    from tasks.harbor.task import read

    failed = 0
    for task in task_dirs(args.dirs):
        try:
            loaded = read(task)
        except ProrlError as exc:
            failed += 1
            print(f"{task.name}: REFUSED {exc.to_dict().get('field', '')}: {exc}")
            continue
        steps = ", ".join(s.name for s in loaded.steps)
        print(f"{task.name}: ok ({loaded.name}; steps: {steps}; strategy {loaded.strategy()})")
    return 1 if failed else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    harbor = sub.add_parser("harbor", help="Harbor task folders: submit them as a dataset, check them")
    verbs = harbor.add_subparsers(dest="verb", required=True)
    submit = verbs.add_parser("submit", help="submit --n samples of each task and print a table of rewards")
    submit.add_argument("dirs", nargs="+", help="task folders, or folders of task folders")
    submit.add_argument("--agent", default=BUILTIN,
                        help="builtin (the service's agent), a harness (oracle, claude_code, codex, "
                             "mini_swe_agent), or a JSON agent block, e.g. '{\"harness\": \"command\", \"command\": \"...\"}'")
    submit.add_argument("--n", type=int, default=8, help="samples per task (one group each)")
    submit.add_argument("--sampling", default=None, help="sampling parameters (JSON)")
    submit.add_argument("--timeout", type=float, default=None, help="seconds to wait for all of them")
    submit.add_argument("--url", default=None, help="the API (default: PRORL_API_URL or the state dir's)")
    submit.add_argument("--state-dir", default=os.environ.get("PRORL_STATE_DIR"),
                        help="read PRORL_API_URL and PRORL_API_TOKEN from <state dir>/secrets.env unless set")
    submit.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    submit.add_argument("--no-audit", action="store_true",
                        help="submit without first auditing the tasks that have no current hack-audit verdict")
    submit.set_defaults(func=_cmd_submit)
    check = verbs.add_parser("check", help="read task folders as the service would; name what is refused")
    check.add_argument("dirs", nargs="+")
    check.set_defaults(func=_cmd_check)
