"""Weight updates under N in-flight multi-turn rollouts: drain vs abort-and-continue vs keep.

One stack (as the README's cluster section starts it; sandboxes of the ``local`` runtime) and a
fake LLM server with the real servers' pause semantics (vLLM's ``/pause?mode=keep|wait|abort``,
recorded in prorl_celery/fakes/llm/pause_api.py), registered as a token-mode backend with
``pause_api: vllm``. For each way of syncing, N rollouts of ``--turns`` turns are submitted at
once, and while they run a trainer thread does ``--updates`` weight syncs every ``--every-s``
seconds: ``POST /llm_servers/pause {"mode"}`` until safe, ``--write-s`` of "writing weights",
``POST /llm_servers/resume {"weight_version"}``. Ways: ``none`` (no updates: the baseline),
``drain`` (wait for the turns in flight), ``abort`` (abort-and-continue: the server ends the turns
with their tokens so far, each goes on from them), ``keep`` (the server freezes them in place),
and ``lease-abort`` (the old ``POST /llm_servers/drain {"abort": true}``: the calls are dropped and
the turns start again from zero) for comparison.

Measured per way: the trainer's pause -> safe-to-write time (the API call; p50 and max) and the
server's own pause (the fake's ``/debug/stats``), tokens thrown away per update (tokens the fake
generated for requests whose client went away), turns restarted, and throughput (rollouts and
kept generated tokens per second over the batch) against ``none``.

    python bench/weight_sync.py [--n 64] [--turns 6] [--turn-tokens 100] [--updates 10] [--every-s 1.2]

Last line: ``weight_sync n= keep_pause_server_ms= keep_tokens_lost= keep_throughput_vs_none= ...``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.private import REDIS_PASSWORD, REDIS_PORT  # noqa: E402  (sets the environment)

import requests  # noqa: E402

from prorl_celery.client import ProrlClient  # noqa: E402
from prorl_celery.ops.launcher import Stack, StackOptions  # noqa: E402

PROBLEM = {"data_source": "math", "problem": "What is 1 + 1?", "answer": "2", "sandbox": {"runtime": "local"}}
WAYS = ("none", "drain", "abort", "keep", "lease-abort", "none")  # the baseline first and last: the mean


def script(turns: int, tokens: int) -> Path:
    steps = [{"content": "t" * tokens, "tool_calls": [{"name": "bash", "arguments": {"command": f"echo {k}"}}]}
             for k in range(turns - 1)]
    steps.append({"content": "s" * tokens, "tool_calls": [{"name": "submit", "arguments": {"answer": "2"}}]})
    path = Path(tempfile.mkdtemp(prefix="bench-weight-sync-")) / "turns.json"
    path.write_text(json.dumps(steps))
    return path


class Trainer(threading.Thread):
    """Does ``updates`` weight syncs, one every ``every_s``, while the batch runs."""

    def __init__(self, client: ProrlClient, way: str, updates: int, every_s: float, write_s: float):
        super().__init__(daemon=True)
        self.client, self.way, self.updates, self.every_s, self.write_s = client, way, updates, every_s, write_s
        self.done = threading.Event()
        self.pauses: list[float] = []
        self.resumes: list[float] = []
        self.unsafe = 0

    def run(self) -> None:
        for k in range(self.updates):
            if self.done.wait(self.every_s):
                return
            started = time.perf_counter()
            if self.way == "lease-abort":
                answer = self.client.drain(wait=60, abort=True)
                safe = answer["drained"]
            else:
                answer = self.client.pause(self.way, wait=60)
                safe = answer["safe"]
            self.pauses.append(time.perf_counter() - started)
            self.unsafe += not safe
            time.sleep(self.write_s)
            started = time.perf_counter()
            self.client.resume(weight_version=f"{self.way}-{k + 1}")
            self.resumes.append(time.perf_counter() - started)


def run_way(client: ProrlClient, fake: str, way: str, args: argparse.Namespace) -> dict:
    requests.post(f"{fake}/debug/reset", timeout=10).raise_for_status()
    client.resume(weight_version=f"{way}-0")
    started = time.perf_counter()
    ids = client.submit_many({"instance": PROBLEM, "sampling_params": {"token_level_generation": True,
                                                                        "max_turns": args.turns + 1}}
                             for _ in range(args.n))
    trainer = Trainer(client, way, 0 if way == "none" else args.updates, args.every_s, args.write_s)
    trainer.start()
    views = list(client.as_completed(ids, timeout=3600))
    wall = time.perf_counter() - started
    trainer.done.set()
    trainer.join()
    stats = requests.get(f"{fake}/debug/stats", timeout=10).json()
    records = requests.get(f"{fake}/debug/requests", timeout=30).json()["requests"]
    dropped = [r for r in records if r["status"] == "aborted"]
    completed = [v for v in views if v["status"] == "completed"]
    kept = sum(sum(v["result"]["tokens"]["loss_mask"]) for v in completed)
    server = [p["server_s"] for p in stats.get("pauses", [])]
    frozen = [p["frozen_s"] for p in stats.get("pauses", []) if "frozen_s" in p]
    updates = max(len(trainer.pauses), 1)
    return {"way": way, "completed": len(completed), "wall_s": wall, "rollouts_per_s": len(completed) / wall,
            "kept_tokens_per_s": kept / wall, "updates": len(trainer.pauses), "unsafe": trainer.unsafe,
            "pause_p50_s": statistics.median(trainer.pauses) if trainer.pauses else 0.0,
            "pause_max_s": max(trainer.pauses, default=0.0),
            "server_pause_max_s": max(server, default=0.0),
            "resume_p50_s": statistics.median(trainer.resumes) if trainer.resumes else 0.0,
            "server_frozen_p50_s": statistics.median(frozen) if frozen else 0.0,
            "tokens_lost_per_update": sum(r.get("produced", 0) for r in dropped) / updates,
            "turns_restarted": len(dropped),
            "continued": sum(1 for r in records if r.get("finish_reason") == "abort"),
            "requests": len(records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--turn-tokens", type=int, default=100, help="tokens of text per turn before its tool call")
    parser.add_argument("--step-s", type=float, default=0.02, help="the fake's seconds per decode step")
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--every-s", type=float, default=1.2)
    parser.add_argument("--write-s", type=float, default=0.0, help="seconds the trainer spends writing weights")
    parser.add_argument("--ways", default=",".join(WAYS))
    args = parser.parse_args()
    capacity = args.n + 64
    options = StackOptions(state_dir=Path(tempfile.mkdtemp(prefix="bench-weight-sync-")),
                           redis_password=REDIS_PASSWORD,
                           concurrency={"init": 16, "run": args.n + 8, "eval": 16, "maint": 1},
                           env={"PRORL_SANDBOX_CAPACITY": str(capacity)})
    stack = Stack(options)
    os.environ["PRORL_API_TOKEN"] = stack.api_token
    stack.start_redis(REDIS_PORT)
    latency = f"step_s={args.step_s},capacity={capacity},slowdown=0"
    rows = []
    with stack:
        fake = stack.start_fake_llm(extra_args=["--policy", f"scripted:{script(args.turns, args.turn_tokens)}",
                                                "--latency-model", latency])
        client = ProrlClient(stack.api_url, timeout=300)
        client.add_llm_server(fake, protocol="generate", dialect="fake", pause_api="vllm", capacity=capacity,
                              weight_version="start")
        warm = argparse.Namespace(**{**vars(args), "n": min(args.n, 16)})
        run_way(client, fake, "none", warm)  # workers, sandboxes and connections warmed up: not measured
        for way in args.ways.split(","):
            row = run_way(client, fake, way, args)
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    nones = [r["rollouts_per_s"] for r in rows if r["way"] == "none"]
    base = {"rollouts_per_s": statistics.mean(nones)} if nones else None
    print(f"{'way':12} {'done':>5} {'wall s':>7} {'rollouts/s':>10} {'vs none':>8} {'pause p50/max ms':>17} "
          f"{'server ms':>9} {'resume ms':>9} {'frozen ms':>9} {'lost tok/upd':>12} {'restarted':>9}")
    tail = []
    for r in rows:
        ratio = r["rollouts_per_s"] / base["rollouts_per_s"] if base else float("nan")
        print(f"{r['way']:12} {r['completed']:>5} {r['wall_s']:>7.1f} {r['rollouts_per_s']:>10.2f} {ratio:>8.3f} "
              f"{r['pause_p50_s'] * 1000:>8.0f}/{r['pause_max_s'] * 1000:<8.0f} {r['server_pause_max_s'] * 1000:>9.1f} "
              f"{r['resume_p50_s'] * 1000:>9.0f} {r['server_frozen_p50_s'] * 1000:>9.0f} "
              f"{r['tokens_lost_per_update']:>12.0f} {r['turns_restarted']:>9}")
        key = r["way"].replace("-", "_")
        if any(t.startswith(f"{key}_") for t in tail):
            continue
        tail.append(f"{key}_pause_ms={r['pause_max_s'] * 1000:.0f} {key}_server_ms={r['server_pause_max_s'] * 1000:.1f} "
                    f"{key}_tokens_lost={r['tokens_lost_per_update']:.0f} {key}_throughput_vs_none={ratio:.3f}")
    print(f"weight_sync n={args.n} " + " ".join(tail))


if __name__ == "__main__":
    main()
