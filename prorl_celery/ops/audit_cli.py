"""``prorl-celery audit``: attack a task set with the hack policies before training on it.

``audit PATH...`` (Harbor task folders, folders of them, JSONL files of instances or SWE-bench
rows) runs, for each task, a no-op agent and each policy of ``tasks/audit/policies/`` through the
service, shows a progress bar, prints a table (the policies that earned more than the no-op, with
their evidence; ``--json`` for everything), and stores each verdict by the task's content hash in
the service's Redis, where submissions of a hackable task meet the quarantine
(``PRORL_AUDIT_POLICY``). Exit status 1 when a task is hackable.

``quarantine PATH... --reason TEXT`` stores the operator's own verdict (policy ``operator``) for
tasks a hack no policy finds makes hackable; ``--lift`` removes whatever verdict the tasks have.

``rescore JOB_ID... | --group G`` replays each kept result through today's graders (a SWE diff or a
Harbor workspace in a new job, an answer domain's answer in process; the stored originals are
untouched) and prints every reward, the changed ones marked (``tasks/audit/rescore.py``). Exit
status 1 when a reward changed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from prorl_celery.ops.harbor_cli import bar


def _summary(v: dict[str, Any]) -> str:
    """The evidence of a hackable task's winning policies, one clause each."""
    parts = []
    for ev in v["evidence"]:
        if ev["policy"] not in v["policies"]:
            continue
        steps = (ev.get("grader") or {}).get("steps") or []
        exits = ",".join(str(s.get("test_exit")) for s in steps)
        did = "; ".join(ev["wrote"][:3]) or "-"
        parts.append(f"{ev['policy']}: reward {ev['reward']:.2f}" + (f" (test exit {exits})" if exits else "")
                     + f"; did: {did}")
    return " | ".join(parts)


def table(verdicts: list[dict[str, Any]]) -> str:
    head = ["task", "verdict", "no-op", "policies that earned", "evidence"]
    body = []
    for v in verdicts:
        faults = [e["policy"] for e in v["evidence"] if e["reward"] is None]
        verdict = "HACKABLE" if v["hackable"] else "not audited" if v.get("note") else "ok"
        body.append([v["task"], verdict + (f" ({len(faults)} faults)" if faults else ""),
                     "-" if v["baseline"] is None else f"{v['baseline']:.2f}",
                     ", ".join(v["policies"]) or "-", _summary(v) or v.get("note") or "-"])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    widths[-1] = len(head[-1])  # the evidence is the line's tail: not padded
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def audit(client: Any, paths: list[str], policy_names: list[str] | None, timeout: float | None,
          out=sys.stderr) -> list[dict[str, Any]]:
    """Run the audit and return the verdicts as JSON-ready dicts (each with ``audited_at``)."""
    from tasks.audit import policies, runner, taskset

    tasks = taskset.load(paths)
    chosen = policies.select(policy_names)
    started = time.monotonic()
    found: list[float] = []

    def progress(done: int, total: int) -> None:
        bar(done, total, found, started, out)

    verdicts = runner.run_audit(client, tasks, chosen, progress=progress, timeout=timeout)
    out.write("\n")
    now = time.time()
    return [{**v.model_dump(mode="json"), "audited_at": now} for v in verdicts]


def _redis(what: str) -> Any:
    """The service's Redis (PRORL_REDIS_URL), or None with a word on stderr."""
    import redis

    url = os.environ.get("PRORL_REDIS_URL")
    if not url:
        print(f"{what}: PRORL_REDIS_URL is not set (nor in --state-dir's secrets): verdicts not stored, "
              "nothing is quarantined", file=sys.stderr)
        return None
    return redis.Redis.from_url(url)


def store(verdicts: list[dict[str, Any]]) -> int:
    """Keep the verdicts in the service's Redis (PRORL_REDIS_URL); how many were stored."""
    from tasks.audit import quarantine

    client = _redis("audit")
    if client is None:
        return 0
    audited = [v for v in verdicts if v.get("content_hash")]  # not a task the service refused to run
    for verdict in audited:
        quarantine.store(client, verdict)
    return len(audited)


def _cmd_audit(args: argparse.Namespace) -> int:
    from prorl_celery.client import ProrlClient
    from prorl_celery.ops.cli import _load_secrets

    _load_secrets(args.state_dir)
    client = ProrlClient(args.url, state_dir=args.state_dir)
    names = [n.strip() for n in args.policies.split(",") if n.strip()] if args.policies else None
    try:
        verdicts = audit(client, args.paths, names, args.timeout)
    except KeyboardInterrupt:
        print("\naudit: cancelled", file=sys.stderr)
        return 130
    stored = 0 if args.no_store else store(verdicts)
    print(json.dumps(verdicts, indent=2) if args.json else table(verdicts))
    hackable = sum(1 for v in verdicts if v["hackable"])
    print(f"audit: {len(verdicts)} tasks, {hackable} hackable; {stored} verdicts stored", file=sys.stderr)
    return 1 if hackable else 0


def _cmd_quarantine(args: argparse.Namespace) -> int:
    from prorl_celery.ops.cli import _load_secrets
    from tasks.audit import quarantine, taskset

    if bool(args.lift) == bool(args.reason):
        raise SystemExit("quarantine: give --reason TEXT (the hack you found) or --lift")
    _load_secrets(args.state_dir)
    client = _redis("quarantine")
    if client is None:
        return 1
    for task in taskset.load(args.paths):
        if args.lift:
            done = quarantine.lift(client, task.instance)
            print(f"{task.name}: {'lifted' if done else 'no verdict stored'}")
        else:
            verdict = quarantine.mark(client, task.name, task.instance, args.reason)
            print(f"{task.name}: quarantined by the operator ({verdict['content_hash']}): {verdict['reason']}")
    return 0


def rescore_table(rows: list[dict[str, Any]]) -> str:
    head = ["job", "data source", "stored", "today", "changed", "replayed as", "note"]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    body = [[r["job_id"], r["data_source"], fmt(r["original"]), fmt(r["today"]), "CHANGED" if r["changed"] else "",
             r.get("how") or "-", r.get("note") or ""] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def _cmd_rescore(args: argparse.Namespace) -> int:
    from prorl_celery.client import ProrlClient
    from prorl_celery.connections import get_store
    from prorl_celery.ops.cli import _load_secrets
    from tasks.audit.rescore import rescore

    _load_secrets(args.state_dir)
    client = ProrlClient(args.url, state_dir=args.state_dir)
    job_ids = list(args.job_ids)
    if args.group:
        job_ids += [s["job_id"] for s in client.group(args.group)["samples"]]
    if not job_ids:
        raise SystemExit("rescore: name job ids or --group")
    rows = [r.model_dump(mode="json") for r in rescore(client, get_store(), job_ids, args.timeout)]
    print(json.dumps(rows, indent=2) if args.json else rescore_table(rows))
    changed = sum(1 for r in rows if r["changed"])
    print(f"rescore: {len(rows)} results, {changed} rewards changed", file=sys.stderr)
    return 1 if changed else 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait for all runs")
    p.add_argument("--url", default=None, help="the API (default: PRORL_API_URL or the state dir's)")
    p.add_argument("--state-dir", default=os.environ.get("PRORL_STATE_DIR"),
                   help="read PRORL_API_URL, PRORL_API_TOKEN and PRORL_REDIS_URL from <state dir>/secrets.env unless set")
    p.add_argument("--json", action="store_true", help="print the rows with everything as JSON")


def add_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("rescore", help="replay kept results through today's graders; report every reward that changes")
    r.add_argument("job_ids", nargs="*", help="finished jobs whose results to replay")
    r.add_argument("--group", default=None, help="every job of this group too")
    _common(r)
    r.set_defaults(func=_cmd_rescore)

    p = sub.add_parser("audit", help="run the hack policies on a task set; table of hackable tasks; quarantine them")
    p.add_argument("paths", nargs="+", help="Harbor task folders (or folders of them), JSONL files of instances "
                                            "or SWE-bench rows")
    p.add_argument("--policies", default=None, help="comma-separated policy names (default: all; see tasks/audit/policies)")
    _common(p)
    p.add_argument("--no-store", action="store_true", help="do not store the verdicts (no quarantine)")
    p.set_defaults(func=_cmd_audit)

    q = sub.add_parser("quarantine", help="the operator's own verdict: quarantine tasks a hack found by hand "
                                          "makes hackable (--reason), or lift any verdict they have (--lift)")
    q.add_argument("paths", nargs="+", help="Harbor task folders (or folders of them), JSONL files of instances")
    q.add_argument("--reason", default=None, help="the hack, in a sentence (shown in GET /audit and at refusal)")
    q.add_argument("--lift", action="store_true", help="remove the verdict each task has (an audit's or the operator's)")
    q.add_argument("--state-dir", default=os.environ.get("PRORL_STATE_DIR"),
                   help="read PRORL_REDIS_URL from <state dir>/secrets.env unless set")
    q.set_defaults(func=_cmd_quarantine)
