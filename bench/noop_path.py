"""A no-op rollout's own cost on the service's path, in this process: what ``bench/overhead.py``'s
"ours" spends beyond Celery's own work (the bare chain's), phase by phase, with the Redis round
trips counted exactly.

On a private Redis (no AOF, as ``bench/overhead.py`` runs it), without Celery workers:

- ``submit``: ``POST /jobs`` of the whole batch through ``create_app()``'s test client (the
  API's checks, the store's create script, the chains sent to the broker on the same Redis);
- ``stages``: ``tasks.stages.run_stage`` of each job's init, run and eval in turn, as a worker's
  task body runs them (the task's own Celery bookkeeping is not here: the bare chain pays it
  too), each stage's CPU and round trips also apart (its Redis CPU only in the whole);
- ``completions``: ``GET /completions?group_id=`` paged through the batch, as ``ProrlClient.as_completed``
  reads it.

Per phase and per rollout: this process's CPU ms, the round trips (a send of a connection: one
command, or one pipeline), and Redis's own CPU µs (``INFO``). ``--handler shell`` runs the shell
handler's ``true`` in a ``local`` sandbox (a sandbox host started here); ``--profile PHASE`` prints
cProfile's top entries of that phase.

    python3 bench/noop_path.py [--jobs 300] [--rounds 3] [--handler noop|shell] [--profile eval]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.private import REDIS_PASSWORD, REDIS_PORT  # noqa: E402  (sets the environment)

os.environ.setdefault("PRORL_API_TOKEN", secrets.token_urlsafe(16))
os.environ["PRORL_PLUGIN_PACKAGES"] = "prorl_celery.fakes"

import redis.connection  # noqa: E402

HANDLERS = {"noop": {"data_source": "prorl_celery.fakes.noop:NoopHandler"},
            "shell": {"data_source": "shell", "commands": ["true"], "sandbox": {"runtime": "local"}}}
PHASES = ("submit", "stages", "completions")
STAGES = ("init", "run", "eval")
SENDS = [0]
_send = redis.connection.AbstractConnection.send_packed_command


def _counting_send(self, command, check_health=True):
    SENDS[0] += 1
    return _send(self, command, check_health)


redis.connection.AbstractConnection.send_packed_command = _counting_send


def _task():
    return SimpleNamespace(request=SimpleNamespace(hostname="bench-noop", chain=None))


def one_round(client, auth, instance: dict, n: int, profile: str | None, info) -> dict[str, tuple[float, float, float]]:
    """Each phase's (CPU ms, round trips, Redis CPU µs) per rollout."""
    from prorl_celery.status import JobStatus
    from tasks.stages import run_stage

    group, out, ids = uuid.uuid4().hex, {}, []

    def submit():
        reply = client.post("/jobs", json={"jobs": [{"instance": instance, "group_id": group} for _ in range(n)]},
                            headers=auth)
        assert reply.status_code == 202, reply.get_data(as_text=True)
        ids.extend(reply.get_json()["job_ids"])

    per_stage = {stage: [0.0, 0] for stage in STAGES}  # CPU seconds, sends

    def stages():  # each job's three stages in turn, as its chain runs them (a sandbox open at a time)
        for job_id in ids:
            for which in STAGES:
                sends, cpu = SENDS[0], time.process_time()
                result = run_stage(_task(), JobStatus(which), job_id)
                per_stage[which][0] += time.process_time() - cpu
                per_stage[which][1] += SENDS[0] - sends
                assert result and "skipped" not in result and result.get("status") != "failed", result

    def completions():
        cursor, seen = "0", 0
        while seen < n:
            reply = client.get(f"/completions?group_id={group}&cursor={cursor}&limit=500&wait=5", headers=auth)
            body = reply.get_json()
            assert all(c["job"]["status"] == "completed" for c in body["completions"]), body
            seen, cursor = seen + len(body["completions"]), body["cursor"]

    steps = {"submit": submit, "stages": stages, "completions": completions}
    for name in PHASES:
        prof = cProfile.Profile() if profile == name else None
        redis_before, sends, cpu = info(), SENDS[0], time.process_time()
        if prof:
            prof.enable()
        steps[name]()
        if prof:
            prof.disable()
        cpu = time.process_time() - cpu
        sends = SENDS[0] - sends - 1  # the INFO below is one
        out[name] = (cpu * 1000 / n, sends / n, (info() - redis_before) / n)
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    for which, (cpu, sends) in per_stage.items():
        out[which] = (cpu * 1000 / n, sends / n, float("nan"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--handler", choices=sorted(HANDLERS), default="noop")
    parser.add_argument("--profile", choices=PHASES, help="print cProfile's top entries of this phase (last round)")
    args = parser.parse_args()
    from prorl_celery.ops.launcher import Stack, StackOptions

    stack = Stack(StackOptions(state_dir=Path(tempfile.mkdtemp(prefix="bench-noop-")), redis_password=REDIS_PASSWORD,
                               persist=False, redis_url=None, beat=False,
                               env={"PRORL_PLUGIN_PACKAGES": "prorl_celery.fakes"}))
    stack.start_redis(REDIS_PORT)
    try:
        if args.handler == "shell":
            stack.start_sandbox_host()
        from flask_api import create_app
        from prorl_celery.connections import get_redis

        head = get_redis()

        def info() -> float:
            cpu = head.info("cpu")
            return (float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])) * 1e6

        client = create_app({"TESTING": True}).test_client()
        auth = {"Authorization": f"Bearer {os.environ['PRORL_API_TOKEN']}"}
        one_round(client, auth, HANDLERS[args.handler], 10, None, info)  # warm up
        rows = [one_round(client, auth, HANDLERS[args.handler], args.jobs,
                          args.profile if r == args.rounds - 1 else None, info) for r in range(args.rounds)]
    finally:
        stack.stop()
    print(f"load average {os.getloadavg()}; handler {args.handler}; jobs {args.jobs}; rounds {args.rounds}")
    print("| phase | CPU ms per rollout (each round) | round trips per rollout | Redis CPU µs per rollout |")
    print("|---|---|---|---|")
    for name in (*PHASES, *STAGES, "total"):
        pick = (lambda r, i: sum(r[p][i] for p in PHASES)) if name == "total" else (lambda r, i: r[name][i])
        cpus = ", ".join(f"{pick(r, 0):.2f}" for r in rows)
        redis_us = statistics.median(pick(r, 2) for r in rows)
        shown = "-" if redis_us != redis_us else f"{redis_us:.0f}"  # NaN: not measured apart
        print(f"| {'  of which ' + name if name in STAGES else name} | {cpus} "
              f"| {statistics.median(pick(r, 1) for r in rows):.1f} | {shown} |")


if __name__ == "__main__":
    main()
