"""LLM load balancing: this pool vs vllm-router, sglang-router, round robin and the reference heap.

Four fake LLM servers of unequal speed (1x, 1x, 0.5x, 0.25x; the fake server's batching latency
model), a closed loop of concurrent multi-turn rollouts that saturates them, and halfway through
a fifth 1x server added. Each strategy gets the same servers, the same rollouts and the same
HTTP client; only the choice of server differs:

- ours: ``LLMPool.generate`` (session affinity per rollout priced by measured speed, decided in
  Redis; ``LLMPool.end_rollout`` after a rollout's last turn);
- rr: plain round robin over the servers, per request;
- ref: the reference system's heap of ``[jobs ever assigned, address]``, never decremented, the
  server pinned per rollout;
- vllm-router / sglang-router (``pip install vllm-router sglang-router``: the Rust routers from
  PyPI) with their least-load (``power_of_two``) and ``cache_aware`` policies, started in front
  of the same servers (``--worker-urls ... --policy ...``), the fifth added over their HTTP API;
  every turn goes through the router. A router that is not installed is left out of the table.

Busy fraction ("GPU utilisation") = the time-averaged fill of the server's batch (running
sequences / capacity), read from the fake server; measured on the four original servers before
the fifth arrives. Throughput counts turns completed over the whole run. The new server's share
is its share of the requests started in the first ``--window-s`` seconds after it was added.

    python bench/load_balance.py [--rollouts 96] [--phase-s 12] [--routers vllm-router:power_of_two,...|none]
        [--prompt-tokens 512 --prefill-s 0.008 --cache-tokens 65536]   (multi-turn, prefill and prefix cache)

With ``--prompt-tokens`` each rollout is a growing conversation (first prompt, then per turn the
reply and an observation appended), and with ``--prefill-s``/``--cache-tokens`` the fake servers
charge prefill for the prompt tokens their prefix cache does not hold, so where a rollout's next
turn lands matters (the cost ratio prefill/decode is the one measured on the real servers here:
bench/RESULTS.md). "cache hit" = the share of prompt tokens the servers found cached. Every
strategy's rollouts have prompts of their own (the servers' caches outlive a strategy's run). Per
strategy, a line gives the share of later turns that went to another server than the rollout's
previous turn ("moved", from the servers' own records) and each server's completed turns and
prefilled tokens per turn.

Last lines: ``util_ours=<> util_rr=<> util_ref=<> thr_vs_ref=<> new_backend_share=<>`` and
``thr_vs_best_router=<> best_router=<> busy_ours=<>``.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.private import REDIS_PASSWORD, REDIS_PORT  # noqa: E402  (sets the environment first)
from prorl_celery.ops.procs import Child, free_port, wait_for  # noqa: E402

import requests  # noqa: E402

from prorl_celery.errors import LLMCallCancelled  # noqa: E402
from prorl_celery.ops.launcher import Stack, StackOptions  # noqa: E402
from prorl_celery.llm import BackendSpec, LLMPool, LLMRequest, Protocol, SamplingParams  # noqa: E402
from prorl_celery.llm.clients.chat import ChatClient  # noqa: E402
from prorl_celery.llm.routing import Slot  # noqa: E402
from prorl_celery.llm.transport import Call, CallAborted  # noqa: E402

SPEEDS = [1.0, 1.0, 0.5, 0.25]
DEFAULT_ROUTERS = ("vllm-router:power_of_two,vllm-router:cache_aware,"
                   "sglang-router:power_of_two,sglang-router:cache_aware")
NEW_SPEED = 1.0
TURNS_PER_ROLLOUT = 4
ROLLOUT_TAG = re.compile(r"task (\d+-\d+) ")


class Server:
    def __init__(self, name: str, speed: float, args: argparse.Namespace, log_dir: Path, capacity: int):
        self.port, self.speed, self.name, self.capacity = free_port(), speed, name, capacity
        self.url = f"http://127.0.0.1:{self.port}"
        latency = (f"step_s={args.step_s},capacity={capacity},slowdown=1,prefill_s={args.prefill_s},"
                   f"cache_tokens={args.cache_tokens}")
        self.child = Child(name, [sys.executable, "-m", "prorl_celery.fakes.llm.server", "--port", str(self.port),
                                  "--latency-model", latency, "--speed", str(speed)], dict(os.environ),
                           log_dir).start()

    def wait(self) -> None:
        wait_for(lambda: _ok(f"{self.url}/health"), 30, self.name, child=self.child)

    def stats(self) -> dict:
        return requests.get(f"{self.url}/debug/stats", timeout=10).json()

    def reset(self) -> None:
        requests.post(f"{self.url}/debug/reset", json={}, timeout=10)

    def received(self) -> list[dict]:
        """The generation requests this server received since its last reset, from its own record."""
        return requests.get(f"{self.url}/debug/requests", timeout=60).json()["requests"]


def placements(servers: list[Server]) -> list[tuple[float, str, str]]:
    """(start, rollout, server name) of every request the servers recorded, in time order; the
    rollout is read back from the prompt (the fake's token ids 0-255 are its bytes)."""
    out = []
    for server in servers:
        for row in server.received():
            found = ROLLOUT_TAG.search(bytes(i for i in row["prompt_ids"] if i < 256).decode(errors="replace"))
            if found:
                out.append((row["t_start"], found.group(1), server.name))
    return sorted(out)


def moved_share(rows: list[tuple[float, str, str]]) -> float:
    """Share of the turns after a rollout's first recorded one that went to another server than
    its previous turn (each such move re-prefills the whole prompt)."""
    last: dict[str, str] = {}
    later = moved = 0
    for _, rollout, server in rows:
        if rollout in last:
            later += 1
            moved += last[rollout] != server
        last[rollout] = server
    return moved / later if later else 0.0


def _ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.RequestException:
        return False


class Strategy:
    """Picks a server per request; ``add`` brings in a new one."""

    name = ""

    def __init__(self, servers: list[Server]):
        self.servers = list(servers)
        self.client = ChatClient()

    def turn(self, job_id: str, request: LLMRequest, stop) -> tuple[str, str]:
        """The server (or router) that answered, and the reply's text."""
        url = self.pick(job_id)
        slot = Slot.direct(backend_id=url, address=url, protocol=Protocol.CHAT, model="prorl-fake-byte")
        with Call(600, should_stop=stop) as call:
            turn = self.client.generate(slot, request, call)
        return url, turn.content or ""

    def pick(self, job_id: str) -> str:
        raise NotImplementedError

    def add(self, server: Server) -> None:
        raise NotImplementedError

    def end(self, job_id: str) -> None:
        """The rollout made its last turn (only our pool is told: no router has such a call)."""


class RoundRobin(Strategy):
    name = "rr"

    def __init__(self, servers: list[Server]):
        super().__init__(servers)
        self.lock = threading.Lock()
        self.counter = itertools.count()

    def pick(self, job_id: str) -> str:
        with self.lock:
            return self.servers[next(self.counter) % len(self.servers)].url

    def add(self, server: Server) -> None:
        with self.lock:
            self.servers.append(server)


class ReferenceHeap(Strategy):
    """A heap of [jobs ever assigned, address]: pop the least, increment, push back; never
    decremented; the rollout keeps its server for all its turns."""

    name = "ref"

    def __init__(self, servers: list[Server]):
        super().__init__(servers)
        self.heap = [[0, s.url] for s in servers]
        heapq.heapify(self.heap)
        self.pinned: dict[str, str] = {}
        self.lock = threading.Lock()

    def pick(self, job_id: str) -> str:
        with self.lock:
            if job_id not in self.pinned:
                entry = heapq.heappop(self.heap)
                entry[0] += 1
                heapq.heappush(self.heap, entry)
                self.pinned[job_id] = entry[1]
            return self.pinned[job_id]

    def add(self, server: Server) -> None:
        with self.lock:
            heapq.heappush(self.heap, [0, server.url])


class Ours(Strategy):
    name = "ours"

    def __init__(self, servers: list[Server], pool: LLMPool):
        super().__init__(servers)
        self.pool = pool
        pool.registry.clear()
        for server in servers:
            self.add(server)

    def turn(self, job_id: str, request: LLMRequest, stop) -> tuple[str, str]:
        turn = self.pool.generate(job_id, request, should_stop=stop)
        return turn.address, turn.content or ""

    def add(self, server: Server) -> None:
        self.pool.registry.add(BackendSpec(address=server.url, capacity=server.capacity, model="prorl-fake-byte"))

    def end(self, job_id: str) -> None:
        self.pool.end_rollout(job_id)


class RouterProxy(Strategy):
    """A router process in front of the same servers: each turn is one chat request through it."""

    ADD = {"vllm-router": ("POST", "/add_worker?url={url}", None),
           "sglang-router": ("POST", "/workers", {"url": "{url}"})}

    def __init__(self, servers: list[Server], binary: str, policy: str, log_dir: Path):
        super().__init__(servers)
        self.binary, self.policy, self.log_dir = binary, policy, log_dir
        self.name = f"{binary.removesuffix('-router')}:{policy}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.child: Child | None = None

    def start(self) -> "RouterProxy":
        argv = [shutil.which(self.binary) or self.binary, *(["launch"] if self.binary == "sglang-router" else []),
                "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *[s.url for s in self.servers],
                "--policy", self.policy, "--prometheus-port", str(free_port()),
                "--log-level", "warn" if self.binary == "sglang-router" else "warning",
                "--request-timeout-secs", "600"]
        self.child = Child(f"{self.binary}-{self.policy}", argv, dict(os.environ), self.log_dir).start()
        wait_for(self._ready, 60, f"{self.binary} --policy {self.policy}", child=self.child)
        return self

    def _ready(self) -> bool:
        body = {"model": "prorl-fake-byte", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        try:
            return requests.post(f"{self.url}/v1/chat/completions", json=body, timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def pick(self, job_id: str) -> str:
        return self.url

    def add(self, server: Server) -> None:
        method, path, body = self.ADD[self.binary]
        payload = {k: v.format(url=server.url) for k, v in body.items()} if body else None
        resp = requests.request(method, self.url + path.format(url=server.url), json=payload, timeout=10)
        resp.raise_for_status()

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop(grace_s=3)


def routers(spec: str, servers: list[Server], log_dir: Path) -> list[RouterProxy]:
    """``vllm-router:power_of_two,sglang-router:cache_aware`` -> the installed ones of them."""
    out = []
    for item in filter(None, (spec or "").split(",")):
        binary, _, policy = item.partition(":")
        if shutil.which(binary) is None:
            print(f"{binary} is not installed (pip install {binary}): left out", flush=True)
            continue
        out.append(RouterProxy(servers, binary, policy or "power_of_two", log_dir))
    return out


def task_text(head: str, size: int) -> str:
    """``head`` padded to ``size`` bytes (the fake's tokens are bytes)."""
    filler = " lorem ipsum dolor sit amet"
    return head + (filler * (size // len(filler) + 1))[: max(size - len(head), 0)]


def run(strategy: Strategy, old: list[Server], new: Server, args: argparse.Namespace) -> dict:
    stop = threading.Event()
    log: list[tuple[float, float, str]] = []  # (start, end, server url) of completed turns
    sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True)

    def rollout_loop(worker: int) -> None:
        for n in itertools.count():
            job_id = f"{strategy.name}-{worker}-{n}"
            # a prompt of its own per rollout, as rollouts of different tasks have (a cache-aware
            # router would pile identical prompts onto one server), and per strategy: the servers'
            # prefix caches outlive a strategy's run, and the same prompts again would find the
            # earlier strategies' blocks (the later strategies prefilled a fifth less for it)
            head = f"task {worker}-{n} {strategy.name}: go"
            messages = [{"role": "user", "content": task_text(head, args.prompt_tokens)}]
            for k in range(TURNS_PER_ROLLOUT):
                if stop.is_set():
                    return
                t0 = time.monotonic()
                try:
                    url, reply = strategy.turn(job_id, LLMRequest(messages=messages, sampling=sampling), stop.is_set)
                except (LLMCallCancelled, CallAborted):
                    return
                log.append((t0, time.monotonic(), url))
                if args.prompt_tokens:  # a multi-turn conversation: the reply and an observation
                    messages = [*messages, {"role": "assistant", "content": reply},
                                {"role": "user", "content": task_text(f"observation {k}", args.observation_tokens)}]
            strategy.end(job_id)

    for server in old + [new]:
        server.reset()
    threads = [threading.Thread(target=rollout_loop, args=(i,), daemon=True) for i in range(args.rollouts)]
    for t in threads:
        t.start()
    time.sleep(args.warmup_s)
    for server in old:
        server.reset()
    t_measure = time.monotonic()
    time.sleep(args.phase_s)
    before = {s.url: s.stats() for s in old}
    new.reset()
    t_added, wall_added = time.monotonic(), time.time()
    strategy.add(new)
    time.sleep(args.phase_s)
    t_end = time.monotonic()
    after = {s.url: s.stats() for s in old + [new]}
    stop.set()
    for t in threads:
        t.join(30)
    # the share is counted by the servers themselves: behind a router every turn names the router
    rows = placements(old + [new])
    window = {s.name: sum(1 for t, _, name in rows if name == s.name and wall_added <= t < wall_added + args.window_s)
              for s in old + [new]}
    done = [entry for entry in log if t_measure <= entry[1] < t_end]
    prompt = sum(after[s.url]["prompt_tokens"] for s in old + [new])
    prefilled = sum(after[s.url]["prefilled_tokens"] for s in old + [new])
    served = sum(after[s.url]["completed"] for s in old + [new])
    return {"util": statistics.mean(before[s.url]["occupancy"] for s in old),
            "cache_hit": 1 - prefilled / prompt if prompt else 0.0,
            "prefill_per_turn": prefilled / served if served else 0.0,
            "busy": statistics.mean(before[s.url]["busy_fraction"] for s in old),
            "util_after": statistics.mean(after[s.url]["occupancy"] for s in old + [new]),
            "per_server": {s.url: before[s.url]["occupancy"] for s in old},
            "throughput": len(done) / (t_end - t_measure),
            "new_share": window[new.name] / max(sum(window.values()), 1), "window_n": sum(window.values()),
            "moved": moved_share(rows),
            "servers": {s.name: (after[s.url]["completed"], after[s.url]["prefilled_tokens"]) for s in old + [new]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=96, help="concurrent rollouts (closed loop)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per turn")
    parser.add_argument("--step-s", type=float, default=0.02, help="decode step of a 1x server, batch of 1")
    parser.add_argument("--capacity", type=int, default=16, help="sequences per server batch")
    parser.add_argument("--capacities", default="",
                        help="per-server batch sizes of the four, e.g. 32,16,8,8 (servers of unequal size; "
                             "default: --capacity each); the added server has --capacity")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--phase-s", type=float, default=12.0, help="seconds before and after the 5th server")
    parser.add_argument("--window-s", type=float, default=3.0, help="new server's share measured over this")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="first prompt of a rollout, in tokens; > 0: each turn appends the reply and an "
                             "observation (a growing conversation); 0: the same short prompt every turn")
    parser.add_argument("--observation-tokens", type=int, default=64, help="tokens of each observation")
    parser.add_argument("--prefill-s", type=float, default=0.0,
                        help="seconds per uncached prompt token on a 1x server (0: prefill is free)")
    parser.add_argument("--cache-tokens", type=int, default=0, help="prefix cache per server, tokens (0: none)")
    parser.add_argument("--routers", default=DEFAULT_ROUTERS,
                        help="comma-separated binary:policy routers to compare, or none")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="bench-lb-"))
    stack = Stack(StackOptions(redis_password=REDIS_PASSWORD, state_dir=state, persist=False, beat=False))
    stack.start_redis(REDIS_PORT)
    sizes = [int(c) for c in args.capacities.split(",")] if args.capacities else [args.capacity] * len(SPEEDS)
    servers = [Server(f"fake-{i}-{s}x", s, args, stack.log_dir, c) for i, (s, c) in enumerate(zip(SPEEDS, sizes))]
    new = Server(f"fake-new-{NEW_SPEED}x", NEW_SPEED, args, stack.log_dir, args.capacity)
    try:
        for server in servers + [new]:
            server.wait()
        import redis

        pool = LLMPool(redis.Redis.from_url(stack.redis_url))
        results = {}
        for strategy in (Ours(servers, pool), RoundRobin(servers), ReferenceHeap(servers)):
            results[strategy.name] = run(strategy, servers, new, args)
            pool.registry.clear()
        for router in routers("" if args.routers == "none" else args.routers, servers, stack.log_dir):
            try:
                router.start()
                results[router.name] = run(router, servers, new, args)
            finally:
                router.stop()
    finally:
        for server in servers + [new]:
            server.child.stop(grace_s=2)
        stack.stop()
    report(results, servers, args)


def report(results: dict, servers: list[Server], args: argparse.Namespace) -> None:
    fair = NEW_SPEED / (sum(SPEEDS) + NEW_SPEED)
    print(f"servers: speeds {SPEEDS} + {NEW_SPEED} added after {args.phase_s:.0f} s; capacities "
          f"{[s.capacity for s in servers]} + {args.capacity}, "
          f"step {args.step_s * 1000:.0f} ms; {args.rollouts} rollouts x {TURNS_PER_ROLLOUT} turns x "
          f"{args.tokens} tokens; first prompt {args.prompt_tokens} tokens (+{args.tokens}+"
          f"{args.observation_tokens} per turn), prefill {args.prefill_s * 1000:.2f} ms/token, "
          f"prefix cache {args.cache_tokens} tokens per server")
    print(f"{'':26} {'util(4)':>8} {'any-busy':>9} {'per server (1x,1x,0.5x,0.25x)':>32} {'util(5)':>8} "
          f"{'turns/s':>8} {'new share':>10} {'cache hit':>10} {'prefill/turn':>13}")
    for name, r in results.items():
        per = " ".join(f"{r['per_server'][s.url]:.2f}" for s in servers)
        print(f"{name:26} {r['util']:8.2f} {r['busy']:9.2f} {per:>32} {r['util_after']:8.2f} "
              f"{r['throughput']:8.1f} {r['new_share']:10.2f} {r['cache_hit']:10.2f} {r['prefill_per_turn']:13.0f}")
    for name, r in results.items():
        print(f"  {name}: moved {r['moved']:.3f} of later turns; per server completed / prefilled per turn: "
              + ", ".join(f"{server} {done} / {tokens / max(done, 1):.0f}" for server, (done, tokens) in r["servers"].items()))
    print(f"fair share of the new server (by speed): {fair:.2f}; requests in its first {args.window_s:.0f} s: "
          + ", ".join(f"{n}={r['window_n']}" for n, r in results.items()))
    ours, rr, ref = results["ours"], results["rr"], results["ref"]
    print(f"util_ours={ours['util']:.2f} util_rr={rr['util']:.2f} util_ref={ref['util']:.2f} "
          f"thr_vs_ref={ours['throughput'] / ref['throughput']:.2f} new_backend_share={ours['new_share']:.2f}")
    routed = {n: r for n, r in results.items() if "router:" in n or n.startswith(("vllm:", "sglang:"))}
    if routed:
        best = max(routed, key=lambda n: routed[n]["throughput"])
        print(f"thr_vs_best_router={ours['throughput'] / routed[best]['throughput']:.2f} best_router={best} "
              f"util_best_router={routed[best]['util']:.2f} util_ours={ours['util']:.2f}")


if __name__ == "__main__":
    main()
