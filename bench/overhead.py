"""Overhead of the service over bare Celery, measured side by side on the same Redis and workers.

Ours: no-op rollouts (the shell handler running one ``true``: sandbox open, one command, close,
result) submitted through the API in one batch and read back through it as a trainer does, from
the batch's completion stream (``/completions?group_id=``, through ``prorl_celery.client``). Bare:
a chain of three no-op tasks (Celery's built-in ``celery.accumulate``, which returns its empty
args) on the init, run and eval queues, sent with ``apply_async`` and read
back by polling the result backend (``backend.get_many``: one MGET of the chains still out every
10 ms), not with ``AsyncResult.get``, which waits on Redis pub/sub and here lost a result now
and then: all three links SUCCESS in the backend, the client subscribed to the last one's
channel, ``get`` waiting until its timeout (the bench "hung"). Celery's Redis result consumer
sends SUBSCRIBE without waiting for its confirmation and then reads the stored result on another
connection; nothing orders the two in Redis, so a SET and PUBLISH that land between the GET and
the SUBSCRIBE would reach no one (the likely cause, read in the code; not traced on the server).
Polling the stored results cannot miss one.

    python bench/overhead.py [--jobs 200] [--rounds 2]

Beside them, two floor rows (``bench/floor_tasks.py``, on the same workers): the bare chain plus
the least a rollout's stage must do by hand, a read of its job and a write of its progress, and
with a shell, also a fresh ``bash -c true`` in the run stage. Ours over its floor is the service's
own overhead over the same work; ours over the bare chain also counts the work itself.

The five are measured one after another in each round, in reverse order every other round; the
CPU each spends per rollout (the stack's processes and their reaped children, this client) is the
figure a shared machine disturbs least, and its ratio is printed per round and of the medians.

Last line: ``overhead_ratio=<ours/bare> p50_ms=<ours p50 submit-to-done>``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench.private import REDIS_PASSWORD, REDIS_PORT  # noqa: E402  (sets the environment)

import psutil  # noqa: E402
from celery import chain  # noqa: E402

from prorl_celery.celery_app import app  # noqa: E402
from prorl_celery.client import ProrlClient  # noqa: E402
from prorl_celery.ops.launcher import Stack, StackOptions  # noqa: E402


SHELL = {"data_source": "shell", "commands": ["true"], "sandbox": {"runtime": "local"}}
NO_SANDBOX = {"data_source": "prorl_celery.fakes.noop:NoopHandler"}
STAGE_QUEUES = ("init", "run", "eval")


def ours(api: str, n: int, instance: dict = SHELL) -> tuple[float, list[float]]:
    client, group = ProrlClient(api, timeout=120), uuid.uuid4().hex
    start = time.perf_counter()
    ids = client.submit_many({"instance": instance, "group_id": group} for _ in range(n))
    views = list(client.as_completed(ids, group_id=group, timeout=300))
    elapsed = time.perf_counter() - start
    assert all(v["status"] == "completed" for v in views), [v["status"] for v in views if v["status"] != "completed"][:3]
    return n / elapsed, [v["timings"]["total"] * 1000 for v in views]


def _chains(links: list[list], start: float) -> tuple[float, list[float]]:
    """Send each job's links as a chain (``apply_async``) and poll the backend until every last
    link is done; the rate since ``start`` and each chain's send-to-done milliseconds."""
    sent = []
    with app.producer_or_acquire() as producer:
        for job_links in links:
            sent.append((time.time(), chain(*job_links).apply_async(producer=producer)))
    metas = dict(app.backend.get_many([result.id for _, result in sent], timeout=300, interval=0.01))
    elapsed = time.perf_counter() - start
    assert all(m["status"] == "SUCCESS" for m in metas.values()), [m for m in metas.values() if m["status"] != "SUCCESS"][:3]
    return len(links) / elapsed, [(_utc(metas[result.id]["date_done"]) - t0) * 1000 for t0, result in sent]


def bare(n: int) -> tuple[float, list[float]]:
    noop = app.signature("celery.accumulate", immutable=True)  # Celery's own trivial task: returns its args
    start = time.perf_counter()
    return _chains([[noop.clone().set(queue=q, routing_key=q) for q in STAGE_QUEUES] for _ in range(n)], start)


def floor(n: int, shell: bool = False) -> tuple[float, list[float]]:
    """The bare chain's way (sent with ``apply_async``, read by polling the backend) with
    :func:`bench.floor_tasks.stage` as its links, each job's hash written first."""
    from bench.floor_tasks import _redis, job_key

    start = time.perf_counter()
    jobs = [uuid.uuid4().hex for _ in range(n)]
    pipe = _redis().pipeline(transaction=False)  # where the stages read them
    for job_id in jobs:
        pipe.hset(job_key(job_id), mapping={"status": "queued", "t_submit": time.time()})
        pipe.expire(job_key(job_id), 3600)
    pipe.execute()
    return _chains([[app.signature("bench.floor.stage", args=(job_id, q, shell), immutable=True).set(queue=q, routing_key=q)
                     for q in STAGE_QUEUES] for job_id in jobs], start)


class _FloorStack(Stack):
    """The stack, its Celery workers also importing the floor's tasks (nothing else changes for ours)."""

    def _child(self, name: str, argv: list[str], env: dict[str, str] | None = None):
        if name.startswith("worker"):
            argv = [*argv, "--include", "bench.floor_tasks"]
        return super()._child(name, argv, env)


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU time so far of each process of the stack (with its reaped children: the sandbox
    shells) and of this one, grouped as workers / api / sandbox host / redis / client."""
    out: dict[str, float] = {"client": sum(psutil.Process().cpu_times()[:2])}
    for name, child in stack.children.items():
        try:
            times = psutil.Process(child.pid).cpu_times()
        except psutil.Error:
            continue
        group = "workers" if name.startswith("worker") else name
        out[group] = out.get(group, 0.0) + times.user + times.system + times.children_user + times.children_system
    return out


def measured(stack: Stack, n: int, run) -> tuple[float, list[float], dict[str, float]]:
    """``run(n)``'s rate and latencies, and the CPU milliseconds per rollout of each group."""
    before = cpu_seconds(stack)
    rate, latencies = run(n)
    after = cpu_seconds(stack)
    return rate, latencies, {k: (after[k] - before.get(k, 0.0)) * 1000 / n for k in after}


def _utc(moment: datetime | str) -> float:
    moment = datetime.fromisoformat(moment) if isinstance(moment, str) else moment
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    load = [os.getloadavg()]
    root = str(Path(__file__).resolve().parent.parent)  # the workers import bench.floor_tasks from here
    options = StackOptions(redis_password=REDIS_PASSWORD, state_dir=Path(tempfile.mkdtemp(prefix="bench-overhead-")),
                           redis_url=None, beat=False, persist=False,
                           env={"PRORL_PLUGIN_PACKAGES": "prorl_celery.fakes",  # the no-op handler's package
                                "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))})
    stack = _FloorStack(options)
    os.environ["PRORL_API_TOKEN"] = stack.api_token  # the client reads it from here
    stack.start_redis(REDIS_PORT)
    with stack:
        runs = [lambda n: ours(stack.api_url, n), lambda n: ours(stack.api_url, n, NO_SANDBOX), bare,
                floor, lambda n: floor(n, shell=True)]
        for run in runs:
            run(10)  # warm up every path
        rows = []
        for r in range(args.rounds):  # every other round in the reverse order: a load that drifts weighs on all
            order = list(range(len(runs))) if r % 2 == 0 else list(reversed(range(len(runs))))
            done = {i: measured(stack, args.jobs, runs[i]) for i in order}
            rows.append(tuple(done[i] for i in range(len(runs))))
        app.backend.result_consumer.stop()  # before Redis goes: it would try to reconnect
    kinds = len(rows[0])
    rate = [statistics.median(r[i][0] for r in rows) for i in range(kinds)]
    p50 = [statistics.median(x for r in rows for x in r[i][1]) for i in range(kinds)]
    print(f"jobs per round: {args.jobs}, rounds: {args.rounds}, workers: {options.concurrency}")
    names = ["ours (shell handler, local sandbox)", "ours (no sandbox)", "bare 3-task chain",
             "floor: bare + job read/write", "floor: + bash -c true"]
    groups = ["workers", "api", "sandbox-host", "redis", "client"]
    cpu = [{g: statistics.median(r[i][2].get(g, 0.0) for r in rows) for g in groups} for i in range(kinds)]
    print(f"{'':<36} {'rate':>10}   {'p50 submit-to-done':>20}   CPU ms per rollout: total "
          + " ".join(groups))
    for name, r, p, c in zip(names, rate, p50, cpu):
        print(f"{name:<36} {r:8.1f}/s   {p:17.1f} ms   {sum(c.values()):24.1f} "
              + " ".join(f"{c[g]:.1f}" for g in groups))
    total = [sum(c.values()) for c in cpu]
    per_round = [[sum(r[i][2].values()) for i in range(kinds)] for r in rows]  # each round's totals: the same load
    print("CPU ratios per round (bare / ours, bare / ours without a sandbox): "
          + ", ".join(f"{t[2] / t[0]:.2f} / {t[2] / t[1]:.2f}" for t in per_round))
    print("CPU ratios per round over the floor (floor + shell / ours, floor / ours without a sandbox): "
          + ", ".join(f"{t[4] / t[0]:.2f} / {t[3] / t[1]:.2f}" for t in per_round))
    print(f"load average at the start {load[0]}, at the end {os.getloadavg()}")
    print(f"CPU ratios (bare CPU / ours, per rollout; steadier than the rates on a shared machine): "
          f"cpu_ratio={total[2] / total[0]:.2f} no_sandbox_cpu_ratio={total[2] / total[1]:.2f}")
    print(f"over the floor (the same work by hand / ours, CPU): floor_cpu_ratio={total[4] / total[0]:.2f} "
          f"no_sandbox_floor_cpu_ratio={total[3] / total[1]:.2f}")
    print(f"no_sandbox_ratio={rate[1] / rate[2]:.2f}")
    print(f"overhead_ratio={rate[0] / rate[2]:.2f} p50_ms={p50[0]:.1f}")


if __name__ == "__main__":
    main()
