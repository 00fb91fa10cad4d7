"""N multi-turn rollouts in flight at once on one node, through the parts as the README's cluster
section starts them: one sandbox host, ``celery -A prorl_celery worker -Q run -c 1050`` and the
other queues, beat, the API.

Each rollout: a bwrap sandbox, three LLM turns against a slow fake server (two ``bash`` tool
calls, then ``submit``), a math reward. One rollout runs alone first (its own duration); then N
are submitted in one request and read back from the completion stream as a trainer does.
Sampled every 0.25 s: jobs in ``run`` and the resident memory of each part of the stack (workers,
API, beat, sandbox host without its sandboxes, Redis); ``mb_per_rollout`` is the growth of their
sum from idle to the peak, divided by the rollouts in flight then.

    python bench/scale.py 1000 [--turn-s 20] [--run-threads 1050]
    python bench/scale.py 200 --turns 40 --context 16k [--turn-s 3]   # the realistic profile

The realistic profile (``--turns``): ``turns - 1`` ``bash`` calls whose observations (a listing
of /usr/bin, cut to size) make the prompt grow to about ``--context`` tokens by the last turn
(the fake's byte tokenizer counts a byte as a token), then ``submit``. Redis is read with
``INFO`` too: the bytes it received per rollout (``total_net_input_bytes``), its memory at the
peak (``used_memory``), each against the size of a finished job's record as the trainer reads
it (``GET /jobs/<id>``: the trajectory with its messages, ids and logprobs).

Last line: ``scale n= peak_in_run= completed= wall_s= rollouts_per_s= mb_per_rollout=`` (and with
``--turns``: ``redis_in_per_traj= redis_peak_per_traj=``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.private import REDIS_PASSWORD, REDIS_PORT  # noqa: E402  (sets the environment)

import psutil  # noqa: E402
import redis  # noqa: E402

from prorl_celery.client import ProrlClient  # noqa: E402
from prorl_celery.ops.launcher import Stack, StackOptions  # noqa: E402

PROBLEM = {"data_source": "math", "problem": "What is 3/4 + 1/4 + 1/2? Give the answer as a decimal.",
           "answer": "1.5", "sandbox": {"runtime": "bwrap"}}
TURNS = [{"content": "Let me compute it.",
          "tool_calls": [{"name": "bash", "arguments": {"command": "python3 -c 'print(3/4 + 1/4 + 1/2)'"}}]},
         {"content": "Check the workspace.",
          "tool_calls": [{"name": "bash", "arguments": {"command": "pwd && ls -a | wc -l"}}]},
         {"content": "The sum is 1.5.", "tool_calls": [{"name": "submit", "arguments": {"answer": "1.5"}}]}]
PARTS = ("worker-init", "worker-run", "worker-eval", "worker-maint", "api", "beat", "sandbox-host", "redis")


def rss_mb(stack: Stack) -> dict[str, float]:
    """Resident MiB of each part; Redis with its server child, the sandbox host without its
    sandboxes (their own processes are not the service's cost). Reads only these processes:
    a walk of /proc for Redis's children, every sample, cost this bench 2.7 s of CPU in the
    25 s of the creates, beside 5,000 sandbox processes (py-spy)."""
    out: dict[str, float] = {}
    for name in PARTS:
        try:
            out[name] = sum(p.memory_info().rss for p in _processes(stack, name)) / 2**20
        except (psutil.Error, AttributeError):
            continue
    return out


_PROCESSES: dict[tuple[int, str], list[psutil.Process]] = {}


def _processes(stack: Stack, name: str) -> list[psutil.Process]:
    """The part's process (Redis: with its server child), looked up once."""
    child = stack.children.get(name)
    key = (child.pid, name)
    if key not in _PROCESSES:
        proc = psutil.Process(child.pid)
        _PROCESSES[key] = [proc, *(proc.children(recursive=True) if name == "redis" else [])]
    return _PROCESSES[key]


def cpu_s(stack: Stack) -> dict[str, float]:
    """CPU seconds so far of each part, with its reaped children (the host's: sandboxes)."""
    out: dict[str, float] = {}
    for name, child in stack.children.items():
        try:
            t = psutil.Process(child.pid).cpu_times()
        except (psutil.Error, AttributeError):
            continue
        out[name] = t.user + t.system + t.children_user + t.children_system
        if name == "sandbox-host":  # its own threads apart from what it reaped (helpers, sandboxes)
            out["sandbox-host:own"] = t.user + t.system
            out["sandbox-host:reaped"] = t.children_user + t.children_system
    return out


def _parts(cpu: dict[str, float]) -> dict[str, float]:
    """The parts of the stack (the sandbox host's own/reaped split left out: it is in its sum)."""
    return {k: v for k, v in cpu.items() if not k.startswith("sandbox-host:")}


class Sampler(threading.Thread):
    """Jobs in ``run`` and the stack's memory, every ``period_s``; keeps the sample at the peak,
    and Redis's own peak of ``used_memory`` with the jobs in ``run`` then."""

    def __init__(self, stack: Stack, period_s: float = 0.25):
        super().__init__(daemon=True)
        from prorl_celery.connections import get_store

        self.stack, self.period_s, self.store = stack, period_s, get_store()
        self.peak, self.at_peak = 0, {}
        self.redis_peak, self.in_run_at_redis_peak = 0, 0
        self.missed, self.last_error = 0, ""
        self.in_run = 0
        self.stop = threading.Event()

    def run(self) -> None:
        import redis

        while not self.stop.wait(self.period_s):
            try:
                in_run = self.store.counts().get("run", 0)
                used = int(self.store.redis.info("memory")["used_memory"])
            except redis.RedisError as exc:  # a slow read on a loaded box: count it, keep sampling
                self.missed += 1
                self.last_error = repr(exc)
                continue
            self.in_run = in_run
            if used >= self.redis_peak:
                self.redis_peak, self.in_run_at_redis_peak = used, in_run
            if in_run >= self.peak:
                self.peak, self.at_peak = in_run, rss_mb(self.stack)


class Window(threading.Thread):
    """The steady state: once the whole batch is in ``run``, each part's CPU and the head's commands
    over ``seconds``, per rollout in flight and second (what a fleet of R rollouts in flight costs
    is R times that, whatever its turns do: leases renewed, watches read, sweeps, the turns)."""

    def __init__(self, stack: Stack, sampler: Sampler, n: int, seconds: float):
        super().__init__(daemon=True)
        self.stack, self.sampler, self.n, self.seconds = stack, sampler, n, seconds
        self.result: dict | None = None

    def run(self) -> None:
        head = self.sampler.store.redis
        routing = redis.Redis.from_url(self.stack.routing_url) if self.stack.routing_url else None
        while self.sampler.in_run < 0.98 * self.n and not self.sampler.stop.is_set():
            time.sleep(0.5)
        time.sleep(5.0)  # the last starts settle
        cpu0, commands0, in0, t0 = cpu_s(self.stack), redis_commands(head), self.sampler.in_run, time.monotonic()
        routing0 = redis_commands(routing) if routing else {}
        time.sleep(self.seconds)
        cpu1, commands1, in1, t1 = cpu_s(self.stack), redis_commands(head), self.sampler.in_run, time.monotonic()
        routing1 = redis_commands(routing) if routing else {}
        rollout_s = (t1 - t0) * (in0 + in1) / 2

        def rates(before: dict, after: dict) -> dict:
            return {k: ((c - before.get(k, (0, 0))[0]) / rollout_s, (u - before.get(k, (0, 0))[1]) / rollout_s)
                    for k, (c, u) in after.items() if c > before.get(k, (0, 0))[0]}
        self.result = {"seconds": t1 - t0, "in_run": (in0, in1),
                       "cpu_us": {k: (cpu1[k] - cpu0.get(k, 0.0)) * 1e6 / rollout_s for k in cpu1},
                       "commands": rates(commands0, commands1), "routing_commands": rates(routing0, routing1)}

    def report(self, turn_s: float) -> None:
        """Per rollout-second and per turn (``turn_s``: seconds a turn took in the batch)."""
        if self.result is None:
            print("steady-state window: not taken (the batch never had every rollout in run)")
            return
        r = self.result
        cpu = sorted(_parts(r["cpu_us"]).items(), key=lambda kv: -kv[1])
        service = sum(v for k, v in cpu if k != "fake-llm")
        print(f"steady state, {r['seconds']:.0f} s with {r['in_run'][0]} -> {r['in_run'][1]} in run, a turn "
              f"{turn_s:.1f} s: CPU per rollout-second (per turn) " + ", ".join(
                  f"{k} {v:.1f} us ({v * turn_s:.0f})" for k, v in cpu)
              + f"; the service without the fake LLM {service:.1f} us ({service * turn_s / 1e3:.2f} ms per turn)")
        own, reaped = r["cpu_us"].get("sandbox-host:own"), r["cpu_us"].get("sandbox-host:reaped")
        if own is not None:
            print(f"steady state, the sandbox host: its own threads {own:.1f} us, what it reaped {reaped:.1f} us "
                  f"per rollout-second ({own * turn_s:.0f} and {reaped * turn_s:.0f} per turn)")
        for name, commands in (("the head's Redis", r["commands"]), ("the routing's Redis", r["routing_commands"])):
            if not commands:
                continue
            calls = sum(c for c, _ in commands.values())
            usec = sum(u for _, u in commands.values())
            top = sorted(commands.items(), key=lambda kv: -kv[1][1])[:12]
            print(f"steady state, {name}: {calls:.3f} commands and {usec:.2f} us inside commands per "
                  f"rollout-second ({calls * turn_s:.1f} and {usec * turn_s:.0f} us per turn): "
                  + ", ".join(f"{k} {c * turn_s:.2f}x {u * turn_s:.1f}us" for k, (c, u) in top))


def redis_commands(client) -> dict[str, tuple[int, int]]:
    """Redis's own count of calls and CPU microseconds per command so far (CONFIG RESETSTAT is
    disabled in the service's Redis: callers subtract two readings)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in stats.items()}


def print_redis(commands: dict[str, tuple[int, int]], n: int) -> None:
    top = sorted(commands.items(), key=lambda kv: -kv[1][1])[:16]
    calls, usec = sum(c for c, _ in commands.values()), sum(u for _, u in commands.values())
    print(f"Redis commands per rollout (total {calls / n:.0f} calls, {usec / n / 1000:.1f} ms in commands): "
          + ", ".join(f"{k} {c / n:.1f}x {u / n / 1000:.2f}ms" for k, (c, u) in top))


def realistic_turns(turns: int, context: int) -> list[dict]:
    """``turns - 1`` bash calls, each observation sized so the prompt nears ``context`` tokens by
    the last turn (~2.5 kB of system prompt, tools and problem; ~155 of call and template glue
    per turn), then submit."""
    observation = max(64, (context - 2500) // max(1, turns - 1) - 155)
    calls = [{"content": f"Step {k}: look at the tools available.",
              "tool_calls": [{"name": "bash", "arguments": {
                  "command": f"ls -la /usr/bin | tail -n +{k + 1} | head -c {observation}"}}]}
             for k in range(turns - 1)]
    return calls + [{"content": "The sum is 1.5.", "tool_calls": [{"name": "submit", "arguments": {"answer": "1.5"}}]}]


def script_file(turn_s: float, turns: list[dict]) -> tuple[Path, str]:
    """The scripted policy, and a latency model whose replies take about ``turn_s`` each."""
    path = Path(tempfile.mkdtemp(prefix="bench-scale-")) / "turns.json"
    path.write_text(json.dumps(turns))
    tokens = max(len(json.dumps(t)) for t in turns)  # byte tokenizer: about a token per byte
    return path, f"step_s={turn_s / tokens:.5f},capacity=100000,slowdown=0"


def one(client: ProrlClient, params: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    view = client.wait(client.submit(PROBLEM, sampling_params=params), timeout=3600)
    assert view["status"] == "completed" and view["result"]["reward"] == 1.0, view
    return time.perf_counter() - start, view


def batch(client: ProrlClient, n: int, params: dict) -> tuple[float, float, list[dict]]:
    group = uuid.uuid4().hex
    start = time.perf_counter()
    ids: list[str] = []
    for first in range(0, n, 250):  # a few large requests, as a trainer's batch would be
        ids += client.submit_many({"instance": PROBLEM, "group_id": group, "sampling_params": params}
                                  for _ in range(first, min(n, first + 250)))
    submitted = time.perf_counter() - start
    views = list(client.as_completed(ids, group_id=group, timeout=3600))
    return submitted, time.perf_counter() - start, views


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int)
    parser.add_argument("--turn-s", type=float, default=20.0, help="seconds per LLM turn (the slow server)")
    parser.add_argument("--run-threads", type=int, default=1050, help="threads of the run worker (-c)")
    parser.add_argument("--turns", type=int, default=0, help="the realistic profile: turns per rollout")
    parser.add_argument("--context", default="16k", help="with --turns: prompt tokens by the last turn (16k, 64k)")
    parser.add_argument("--store-shards", type=int, default=0,
                        help="the rollouts' lists on N Redis of their own (prorl_celery/shards.py); 0: the head's")
    parser.add_argument("--window", type=float, default=0.0,
                        help="seconds of the steady state measured once the whole batch is in run (0: none)")
    parser.add_argument("--no-alone", action="store_true", help="skip the one rollout alone (no wall goal)")
    parser.add_argument("--routing-redis", action="store_true",
                        help="the LLM routing on a Redis of its own (prorl_celery/llm/store.py)")
    args = parser.parse_args()
    context = int(args.context.lower().removesuffix("k")) * (1000 if args.context.lower().endswith("k") else 1)
    turns = realistic_turns(args.turns, context) if args.turns else TURNS
    params = {"max_turns": len(turns) + 1} if args.turns else {}
    capacity = max(args.n, args.run_threads) + 64
    options = StackOptions(state_dir=Path(tempfile.mkdtemp(prefix="bench-scale-")), redis_password=REDIS_PASSWORD,
                           concurrency={"init": 64, "run": args.run_threads, "eval": 32, "maint": 2},
                           store_shards=args.store_shards, routing_redis=args.routing_redis,
                           env={"PRORL_SANDBOX_CAPACITY": str(capacity), "PRORL_LLM_DEFAULT_CAPACITY": str(capacity)})
    stack = Stack(options)
    os.environ["PRORL_API_TOKEN"] = stack.api_token  # the client reads it from here
    stack.start_redis(REDIS_PORT)
    script, latency = script_file(args.turn_s, turns)
    with stack:
        url = stack.start_fake_llm(extra_args=["--policy", f"scripted:{script}", "--latency-model", latency])
        stack.register_llm(url, capacity=capacity)
        client = ProrlClient(stack.api_url, timeout=300)
        alone, alone_view = (0.0, None) if args.no_alone else one(client, params)
        idle = rss_mb(stack)
        sampler = Sampler(stack)
        redis_before = sampler.store.redis.info()
        sampler.start()
        window = Window(stack, sampler, args.n, args.window)
        if args.window:
            window.start()
        commands_before = redis_commands(sampler.store.redis)
        cpu_before = cpu_s(stack)
        submitted, wall, views = batch(client, args.n, params)
        cpu_after = cpu_s(stack)
        redis_after = sampler.store.redis.info()
        commands = {k: (c - commands_before.get(k, (0, 0))[0], u - commands_before.get(k, (0, 0))[1])
                    for k, (c, u) in redis_commands(sampler.store.redis).items()}
        sampler.stop.set()
        sampler.join()
        if args.window:
            window.join(timeout=args.window + 10)
        shards_mb = [int(c.info("memory")["used_memory"]) / 1e6 for c in store_clients(stack)]
    statuses: dict[str, int] = {}
    for view in views:
        statuses[view["status"]] = statuses.get(view["status"], 0) + 1
    completed = statuses.get("completed", 0)
    grown = {k: sampler.at_peak.get(k, 0.0) - idle.get(k, 0.0) for k in idle}
    per = sum(grown.values()) / max(sampler.peak, 1)
    waits = sorted(v["timings"].get("init_wait", 0.0) for v in views)
    stages = {k: sorted(v["timings"].get(k, 0.0) for v in views) for k in ("queue", "init", "run", "eval")}
    goal = 1.5 * (alone + submitted)
    print(f"one rollout alone: {alone:.1f} s; submission of {args.n}: {submitted:.1f} s; "
          f"wall goal (1.5 x both): {goal:.1f} s")
    if sampler.missed:
        print(f"sampler: {sampler.missed} samples missed (Redis slow to answer: {sampler.last_error})")
    print(f"statuses: {statuses}; init_wait p50 {waits[len(waits) // 2]:.2f} s max {waits[-1]:.2f} s")
    print("per rollout p50 / max s: " + ", ".join(
        f"{k} {t[len(t) // 2]:.1f} / {t[-1]:.1f}" for k, t in stages.items()))
    cpu = {k: (cpu_after[k] - cpu_before.get(k, 0.0)) * 1000 / args.n for k in _parts(cpu_after)}
    if args.window:
        window.report(stages["run"][len(stages["run"]) // 2] / max(1, len(turns)))
    print(f"CPU ms per rollout (total {sum(cpu.values()):.0f}): "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])))
    print_redis(commands, args.n)
    if shards_mb:
        print(f"store shards' memory after the batch: {', '.join(f'{m:.1f}' for m in shards_mb)} MB "
              "(the head's above holds no rollout's lists)")
    print("memory MiB idle -> at peak: " + ", ".join(
        f"{k} {idle[k]:.0f}->{sampler.at_peak.get(k, 0.0):.0f}" for k in idle))
    tail = ""
    if args.turns and alone_view is not None:
        tail = print_redis_bytes(redis_before, redis_after, sampler, views, alone_view, args.n)
    print(f"scale n={args.n} peak_in_run={sampler.peak} completed={completed} wall_s={wall:.1f} "
          f"rollouts_per_s={completed / wall:.2f} mb_per_rollout={per:.2f}{tail}")


def store_clients(stack: Stack) -> list:
    import redis

    return [redis.Redis.from_url(url) for url in stack.shard_urls]


def print_redis_bytes(before: dict, after: dict, sampler: Sampler, views: list[dict], alone: dict,
                      n: int) -> str:
    """What Redis took in and held, against the finished records' size; the last line's tail."""
    record = sum(len(json.dumps(v)) for v in views) / max(1, len(views))
    tokens = alone["result"].get("tokens") or {}
    final = len(tokens.get("prompt_ids") or []) + len(tokens.get("response_ids") or [])
    received = (after["total_net_input_bytes"] - before["total_net_input_bytes"]) / n
    peak = sampler.redis_peak - before["used_memory"]
    in_flight = n * record  # the batch's records: in flight at once when the run keeps up, held after
    print(f"realistic profile: final sequence {final} tokens, {alone['result'].get('turns')} turns; finished "
          f"record (GET /jobs/<id>) {record / 1e3:.1f} kB; Redis received {received / 1e6:.2f} MB per rollout "
          f"({received / record:.2f}x the record, goal <= 2); Redis memory {before['used_memory'] / 1e6:.1f} -> "
          f"peak {sampler.redis_peak / 1e6:.1f} MB with {sampler.in_run_at_redis_peak} in run "
          f"(growth {peak / in_flight:.2f}x the batch's finished records, goal <= 1.5); held after: "
          f"{(after['used_memory'] - before['used_memory']) / n / 1e3:.1f} kB per rollout")
    return f" redis_in_per_traj={received / record:.2f} redis_peak_per_traj={peak / in_flight:.2f}"


if __name__ == "__main__":
    main()
