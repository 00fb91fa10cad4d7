"""Weighted fair share under saturation, and what admission costs per submission.

Starts the service (4 init, 8 run, 4 eval threads, the ``local`` runtime) and, per scenario,
makes projects with the given weights; each submits its whole load at once (skewed: the
lightest-weighted project submits several times what its weight could finish, and first), of
rollouts that each hold a run thread for ``--sleep`` seconds (a shell ``sleep``: the stand-in for
a slow agent; the fake LLM's latency would do the same to a run thread). Every project stays
backlogged through the measurement, so the service is saturated. After ``--warmup`` seconds,
completions are counted for ``--window`` seconds per project (by the store's finish time); each
project's share of them is compared with its weight's share.

Admission overhead: per submission of one job by a project, the fair-share scripts' time (the
enqueue with its quota checks, and one release attempt) with every project's backlog pending,
and the API's answer time of ``POST /jobs`` with a project's key against the operator's token
(whose jobs skip fair share).

    python3 bench/fair_share.py [--window 40] [--sleep 0.5]
    python3 bench/fair_share.py --only-llm     # the LLM router's share alone (a Redis, no stack)

LLM backends' capacity: the router alone on one backend of capacity 8, two projects (weights 1
and 3) with 16 callers each holding a slot 50 ms per call, for 15 s: each one's share of the
calls done against its weight's.

Last line: ``fair_share two_max_err=<> four_max_err=<> llm_max_err=<> admission_p50_ms=<>``
(relative error of a share against its weight's, the worst project).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.private import REDIS_PASSWORD, REDIS_PORT  # noqa: E402  (sets the environment)

import redis  # noqa: E402
import requests  # noqa: E402

from prorl_celery import keys  # noqa: E402
from prorl_celery.fairshare import FairShare  # noqa: E402
from prorl_celery.ops.launcher import Stack, StackOptions  # noqa: E402
from prorl_celery.projects import ProjectStore  # noqa: E402

# (weight, skew): a project's load is skew x 1.5 x what its weight's share of the run threads could
# finish in the warmup and the window, so that every project stays backlogged throughout; the
# lightest-weighted project submits the most, first.
SCENARIOS = {"two": [(1.0, 6), (3.0, 1)], "four": [(1.0, 8), (1.0, 1), (2.0, 1), (4.0, 1)]}
RUN_THREADS = 8


def _job(sleep_s: float) -> dict:
    return {"instance": {"data_source": "shell", "commands": [f"sleep {sleep_s}"], "sandbox": {"runtime": "local"}}}


def run_scenario(api: str, client: redis.Redis, plan: list[tuple[float, int]], args) -> float:
    store, tag = ProjectStore(client), uuid.uuid4().hex[:6]
    made, capacity = [], RUN_THREADS / args.sleep * (args.warmup + args.window)
    total_weight = sum(w for w, _ in plan)
    for i, (weight, skew) in enumerate(plan):
        load = int(skew * 1.5 * capacity * weight / total_weight)
        name = f"bench-{tag}-{i}"
        made.append((name, weight, load, {"Authorization": f"Bearer {store.add(name, weight).key}"}))
    ids: dict[str, list[str]] = {}
    for name, _, load, key in sorted(made, key=lambda m: -m[2]):  # the heaviest load first
        ids[name] = []
        for start in range(0, load, 500):
            resp = requests.post(f"{api}/jobs", json={"jobs": [_job(args.sleep)] * min(500, load - start)},
                                 headers=key, timeout=120)
            resp.raise_for_status()
            ids[name] += resp.json()["job_ids"]
    time.sleep(args.warmup)
    t0 = time.time()
    time.sleep(args.window)
    t1 = time.time()
    done = {}
    for name, job_ids in ids.items():
        pipe = client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(keys.job(job_id), "t_finished")
        done[name] = sum(1 for t in pipe.execute() if t and t0 <= float(t) < t1)
    total_done, total_weight = sum(done.values()), sum(w for _, w, _, _ in made)
    worst = 0.0
    print(f"  {'project':<18} {'weight':>6} {'load':>5} {'done/min':>9} {'share':>7} {'weight share':>12} {'error':>7}")
    for name, weight, load, key in made:
        share, want = done[name] / max(total_done, 1), weight / total_weight
        worst = max(worst, abs(share - want) / want)
        print(f"  {name:<18} {weight:>6g} {load:>5} {done[name] * 60 / (t1 - t0):>9.1f} {share:>7.3f} "
              f"{want:>12.3f} {(share - want) / want:>+7.1%}")
        requests.post(f"{api}/cancel_all", json={}, headers=key, timeout=300)
    print(f"  completed in the window: {total_done} in {t1 - t0:.0f} s; worst relative error {worst:.1%}")
    return worst


def admission(api: str, client: redis.Redis, operator_token: str) -> float:
    """Per-submission cost of fair share's scripts (ms, p50), and the API's answer times."""
    store = ProjectStore(client)
    names = [f"adm-{uuid.uuid4().hex[:6]}-{i}" for i in range(4)]
    for name in names:
        store.add(name)
    fair = FairShare(client)
    for name in names:  # a backlog pending (ids never stored: the release script keeps them a while)
        fair.enqueue(name, [(f"{name}-b{i}", 0) for i in range(2500)])
    samples = []
    for i in range(2000):
        t = time.perf_counter()
        fair.enqueue(names[i % 4], [(f"{names[i % 4]}-s{i}", 0)])
        fair.release()
        samples.append((time.perf_counter() - t) * 1000)
    for name in names:
        client.delete(keys.fair_pending(name), keys.fair_pending_since(name))
        client.zrem(keys.fair_active(), name)
    key = {"Authorization": f"Bearer {store.add(names[0]).key}"}
    times: dict[str, list[float]] = {"operator": [], "project": []}
    http = requests.Session()
    for _ in range(300):  # interleaved: the machine's other load falls on both alike
        for who, headers in (("operator", {"Authorization": f"Bearer {operator_token}"}), ("project", key)):
            t = time.perf_counter()
            http.post(f"{api}/jobs", json=_job(0), headers=headers, timeout=30).raise_for_status()
            times[who].append((time.perf_counter() - t) * 1000)
    answer = {who: statistics.median(values) for who, values in times.items()}
    p50 = statistics.median(samples)
    print(f"  fair-share scripts per submission (enqueue + release, 4 x 2,500 pending): p50 {p50:.3f} ms, "
          f"p99 {sorted(samples)[int(0.99 * len(samples))]:.3f} ms")
    print(f"  POST /jobs (one job) p50: operator {answer['operator']:.2f} ms, project {answer['project']:.2f} ms")
    return p50


def llm_share(client: redis.Redis, seconds: float = 15.0, call_s: float = 0.05) -> float:
    """The LLM router alone: one backend of capacity 8, two projects (weights 1 and 3) with 16
    callers each, every call holding its slot ``call_s``; each project's share of the calls done
    against its weight's. Returns the worst relative error."""
    import threading

    from prorl_celery.jobs import JobStore
    from prorl_celery.llm import BackendSpec
    from prorl_celery.llm.registry import BackendRegistry
    from prorl_celery.llm.routing import Router, Slot
    from prorl_celery.models import JobRequest

    projects, store, tag = ProjectStore(client), JobStore(client), uuid.uuid4().hex[:6]
    plan = {f"llm-{tag}-a": 1.0, f"llm-{tag}-b": 3.0}
    backend, _ = BackendRegistry(client).add(BackendSpec(address="http://10.0.9.1:1", capacity=8, probe=False))
    done = {name: 0 for name in plan}
    stop_at = time.monotonic() + seconds

    def caller(name: str, i: int) -> None:
        router, job_id = Router(redis.Redis.from_url(os.environ["PRORL_REDIS_URL"])), f"{name}-{i}"
        while time.monotonic() < stop_at:
            slot = router.acquire(job_id)
            if not isinstance(slot, Slot):
                time.sleep(0.01)
                continue
            time.sleep(call_s)
            router.release(slot, "ok")
            done[name] += 1

    threads = []
    for name, weight in plan.items():
        projects.add(name, weight)
        store.create_many([(f"{name}-{i}", JobRequest(instance={"data_source": "shell"})) for i in range(16)], name)
        threads += [threading.Thread(target=caller, args=(name, i)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    BackendRegistry(client).remove(backend.id)
    total, worst = sum(done.values()), 0.0
    for name, weight in plan.items():
        share, want = done[name] / total, weight / sum(plan.values())
        worst = max(worst, abs(share - want) / want)
        print(f"  {name:<18} weight {weight:g}: {done[name]} calls, share {share:.3f} against {want:.3f} "
              f"({(share - want) / want:+.1%})")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=40.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--sleep", type=float, default=0.5)
    parser.add_argument("--only-llm", action="store_true", help="only the router's share (no stack)")
    args = parser.parse_args()
    if args.only_llm:
        redis_only = Stack(StackOptions(redis_password=REDIS_PASSWORD, persist=False,
                                        state_dir=Path(tempfile.mkdtemp(prefix="bench-fair-"))))
        redis_only.start_redis(REDIS_PORT)
        try:
            llm_share(redis.Redis.from_url(os.environ["PRORL_REDIS_URL"]))
        finally:
            redis_only.stop()
        return
    options = StackOptions(redis_password=REDIS_PASSWORD, state_dir=Path(tempfile.mkdtemp(prefix="bench-fair-")),
                           persist=False, concurrency={"init": 4, "run": RUN_THREADS, "eval": 4, "maint": 1})
    stack = Stack(options)
    stack.start_redis(REDIS_PORT)
    with stack:
        client = redis.Redis.from_url(os.environ["PRORL_REDIS_URL"])
        errors = {}
        for name, plan in SCENARIOS.items():
            print(f"{name} projects (weight, load skew): {plan}")
            errors[name] = run_scenario(stack.api_url, client, plan, args)
            time.sleep(5)
        print("LLM backends' capacity (the router alone)")
        errors["llm"] = llm_share(client)
        print("admission overhead")
        p50 = admission(stack.api_url, client, stack.api_token)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"fair_share two_max_err={errors['two']:.3f} four_max_err={errors['four']:.3f} "
          f"llm_max_err={errors['llm']:.3f} admission_p50_ms={p50:.3f}")


if __name__ == "__main__":
    main()
