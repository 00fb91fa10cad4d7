"""DAPO-style dynamic sampling against the service, side by side with the batch-by-batch baseline.

A training batch needs B prompts whose n samples do not all get the same reward (a group with
equal rewards has zero advantage and teaches nothing). Two ways to fill it:

- dynamic: keep K groups in flight; as each group completes, keep it or drop it; refill at once;
  when B groups are kept, cancel everything still running (one bulk cancel);
- baseline: submit B groups, wait for all of them, keep the useful ones, repeat for the shortfall.

Both run against the fake LLM (a policy that solves each prompt with its own probability) through
a private service this script starts, in one run:

    python examples/dapo_dynamic_sampling.py [--batch 16] [--n 8] [--in-flight 24]

It prints, for each: batch fill time, rollouts finished but wasted (dropped groups, and samples of
groups cancelled), rollouts cancelled, and useful rollouts per second.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prorl_celery.ops.procs import free_port  # noqa: E402

if "PRORL_REDIS_URL" not in os.environ or __name__ == "__main__":
    os.environ["PRORL_REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"

from examples.dapo_policy import problem  # noqa: E402
from prorl_celery.client import ProrlClient  # noqa: E402
from prorl_celery.ops.launcher import Stack, StackOptions  # noqa: E402

TERMINAL = {"completed", "failed", "cancelled", "timeout"}


def useful(rewards: list[float]) -> bool:
    return len(rewards) > 1 and len(set(rewards)) > 1


def dynamic(client: ProrlClient, prompts, batch: int, n: int, in_flight: int) -> dict:
    start = time.monotonic()
    cursor = client.completions("latest")["cursor"]
    groups: dict[str, dict[str, float]] = {}
    kept, dropped_rollouts = [], 0
    while len(kept) < batch:
        while len(groups) < in_flight:
            gid, _ = client.submit_group(problem(next(prompts)), n=n)
            groups[gid] = {}
        page = client.completions(cursor, wait=5)
        cursor = page["cursor"]
        for item in page["completions"]:
            gid = item.get("group_id")
            if gid not in groups:
                continue
            groups[gid][item["job_id"]] = (item["job"]["result"] or {}).get("reward", 0.0)
            if len(groups[gid]) == n:
                rewards = list(groups.pop(gid).values())
                if useful(rewards) and len(kept) < batch:
                    kept.append(gid)
                else:
                    dropped_rollouts += n
    fill = time.monotonic() - start
    finished_extra = cancelled = 0
    for gid in list(groups):
        cancelled += len(client.cancel_group(gid))
        finished_extra += len(groups[gid])
    return {"fill_s": fill, "wasted": dropped_rollouts + finished_extra, "cancelled": cancelled,
            "useful_per_s": batch * n / fill, "kept": kept}


def baseline(client: ProrlClient, prompts, batch: int, n: int) -> dict:
    start = time.monotonic()
    kept, wasted = [], 0
    while len(kept) < batch:
        ids = [client.submit_group(problem(next(prompts)), n=n) for _ in range(batch - len(kept))]
        for gid, job_ids in ids:
            rewards = [(v["result"] or {}).get("reward", 0.0) for v in client.as_completed(job_ids)]
            if useful(rewards):
                kept.append(gid)
            else:
                wasted += n
    fill = time.monotonic() - start
    return {"fill_s": fill, "wasted": wasted, "cancelled": 0, "useful_per_s": batch * n / fill, "kept": kept}


def run(batch: int, n: int, in_flight: int, step_s: float = 0.01, stack: Stack | None = None) -> dict[str, dict]:
    own = stack is None
    if own:
        options = StackOptions(state_dir=Path(tempfile.mkdtemp(prefix="dapo-")), persist=False,
                               concurrency={"init": 16, "run": 64, "eval": 16, "maint": 1},
                               env={"PRORL_SANDBOX_CAPACITY": "256"})
        stack = Stack(options)
        stack.start_redis(int(os.environ["PRORL_REDIS_URL"].rsplit(":", 1)[1].split("/")[0]))
        stack.start()
    try:
        url = stack.start_fake_llm(name="fake-dapo", extra_args=[
            "--policy", "oracle:examples.dapo_policy:reply", "--latency-model", f"step_s={step_s},capacity=512"])
        client = ProrlClient(stack.api_url, token=stack.api_token)
        client.add_llm_server(url)
        baseline(client, itertools.count(10**6), 2, n)  # warm up workers, sandboxes and verifiers
        results = {"dynamic": dynamic(client, itertools.count(0), batch, n, in_flight),
                   "baseline": baseline(client, itertools.count(0), batch, n)}
    finally:
        if own:
            stack.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="prompts (groups) per training batch")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--in-flight", type=int, default=24, help="groups kept in flight (dynamic)")
    parser.add_argument("--step-s", type=float, default=0.01, help="fake LLM seconds per decoding step")
    args = parser.parse_args()
    results = run(args.batch, args.n, args.in_flight, args.step_s)
    print(f"batch of {args.batch} prompts x {args.n} samples")
    for name, r in results.items():
        print(f"{name:<9} fill {r['fill_s']:7.2f} s   wasted {r['wasted']:4d} rollouts   "
              f"cancelled {r['cancelled']:4d}   useful {r['useful_per_s']:6.1f} rollouts/s")
    d, b = results["dynamic"], results["baseline"]
    print(f"fill_speedup={b['fill_s'] / d['fill_s']:.2f} dynamic_fill_s={d['fill_s']:.2f} "
          f"baseline_fill_s={b['fill_s']:.2f}")


if __name__ == "__main__":
    main()
