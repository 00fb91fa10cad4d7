"""What the session gateway adds to an LLM call, beside the same calls sent straight to the same
server and through LiteLLM's proxy (the gateway a user would otherwise put in front).

    python bench/gateway.py --sessions 1,256 --calls 4 --litellm ~/.cache/prorl-bench/litellm/bin/litellm

Each session is a harness's loop: ``--calls`` chat completions with tools, each resending the
whole conversation plus the last answer and a tool result. The server is the fake LLM, in one of
two cases:

- the stress case (``--latency-model none``, the default): it answers at once, so what is
  measured is the path alone, and on a small machine every proxy competes with the server and
  the clients for the same cores;
- the realistic case (``--latency-model realistic``: ``REALISTIC`` below, or any spec of the
  fake's): a batching GPU server whose own time per call dominates, as a real one's does; the
  throughput beside direct calls is then what a user sees.

``--host-processes N`` spreads the sessions over N gateway host processes, as a node's run worker
started as N processes (``PRORL_RUN_WORKER_PROCESSES``) spreads its harness sessions.

Three paths, each run at every concurrency:

- ``direct``: OpenAI chat to the fake server's ``/v1/chat/completions``;
- ``gateway``: OpenAI chat to one gateway per session (in separate host processes, recording every call in
  Redis), which renders the prompt to ids (appending to the session's own ids) and generates
  through the LLM pool on the fake server's token API;
- ``litellm``: OpenAI chat to a LiteLLM proxy (its own venv, a pinned version: 1.107.0 was a
  compromised release and is never used) forwarding to the fake server's chat API.

Per path: p50 and p99 latency per call, throughput (calls/s at that concurrency), and the CPU
milliseconds per call of the path's own process (the gateway host or the LiteLLM proxy). The
goals (issue 26): added p50 <= 2 ms; throughput >= 0.95 of direct; ahead of LiteLLM on both.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.private import REDIS_PASSWORD, REDIS_PORT  # noqa: E402  (sets the environment)

import psutil  # noqa: E402
import requests  # noqa: E402

from prorl_celery import keys  # noqa: E402
from prorl_celery.ops.launcher import Stack, StackOptions  # noqa: E402
from prorl_celery.ops.procs import free_port, wait_for  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}}}}]
SCRIPT = [{"content": "Looking.", "tool_calls": [{"name": "bash", "arguments": {"cmd": "ls -la"}}]},
          {"content": "", "tool_calls": [{"name": "bash", "arguments": {"cmd": "cat setup.py"}}]},
          {"content": "", "tool_calls": [{"name": "bash", "arguments": {"cmd": "python -m pytest -x"}}]},
          {"content": "Done."}]
SYSTEM = "You are a software engineer. " * 40  # a system prompt of some length, as harnesses send
# A server whose time dominates, as a real one's does: 25 ms per decode step alone (40 tokens/s
# per sequence, a ~30B model on one GPU), up to twice that with a full batch of 256 sequences,
# 20 us per uncached prompt token (50k tokens/s prefill) and a prefix cache holding every
# session's history (vLLM's automatic prefix caching): a call of this script's ~60-100 generated
# tokens takes 1.5-5 s, about what an agent's turn takes on a real server.
REALISTIC = "step_s=0.025,capacity=256,slowdown=1,prefill_s=0.00002,cache_tokens=4000000"


def serve(args: argparse.Namespace) -> None:
    """The gateway host: ``--sessions`` gateways on loopback ports; prints their URLs and tokens,
    serves until stdin closes."""
    import redis

    from prorl_celery.gateway import CallLog, Gateway, GatewaySession
    from prorl_celery.llm import LLMPool
    from prorl_celery.rollout.store import RolloutStore

    # bench.private set a URL of its own: the stack's is passed aside; a pool as the service's own
    client = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(
        os.environ["PRORL_BENCH_REDIS_URL"], max_connections=1024, timeout=30, socket_keepalive=True))
    pool, store, gateways = LLMPool(client, defer_release=True), RolloutStore(client), []
    for _ in range(args.sessions):
        sid = f"bench-{secrets.token_hex(6)}"
        session = GatewaySession(sid, lambda req, stop, sid=sid: pool.generate(sid, req, should_stop=stop),
                                 CallLog.to_store(store, sid), after_answer=pool.send_releases)
        gateways.append(Gateway(session, token=secrets.token_urlsafe(16)).start())
    print(json.dumps([[g.url, g.token] for g in gateways]), flush=True)
    if os.environ.get("PRORL_BENCH_PROFILE"):  # where the gateway host's time goes (all threads)
        import yappi

        yappi.set_clock_type(os.environ.get("PRORL_BENCH_CLOCK", "wall"))
        yappi.start()
        sys.stdin.read()
        yappi.get_func_stats().sort(os.environ.get("PRORL_BENCH_SORT", "ttot")).print_all(out=open(os.environ["PRORL_BENCH_PROFILE"], "w"),
                                                        columns={0: ("name", 90), 1: ("ncall", 8), 2: ("tsub", 8), 3: ("ttot", 8)})
        return
    sys.stdin.read()


def one_session(base: str, key: str, calls: int, latencies: list[float], http: requests.Session) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the failing test."}]
    for k in range(calls):
        t0 = time.perf_counter()
        resp = http.post(f"{base}/chat/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                         json={"model": "prorl-fake-byte", "messages": messages, "tools": TOOLS, "max_tokens": 200})
        latencies.append(time.perf_counter() - t0)
        resp.raise_for_status()
        message = resp.json()["choices"][0]["message"]
        messages.append({k2: v for k2, v in message.items() if v is not None and k2 in ("role", "content", "tool_calls")})
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"output {k}\n" * 5})


def run_path(targets: list[tuple[str, str]], calls: int, proc) -> dict[str, float]:
    """``proc``: the path's own process(es), whose CPU is counted (None: not counted)."""
    latencies: list[float] = []
    sessions = [requests.Session() for _ in targets]
    cpu0 = _cpu(proc)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one_session, args=(base, key, calls, latencies, http))
               for (base, key), http in zip(targets, sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    cpu = _cpu(proc) - cpu0
    latencies.sort()
    n = len(latencies)
    return {"p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * latencies[min(n - 1, int(0.99 * n))],
            "calls_per_s": n / wall, "cpu_ms_per_call": 1000 * cpu / n if proc else float("nan"), "calls": n}


def _cpu(proc) -> float:
    if proc is None:
        return 0.0
    procs = proc if isinstance(proc, list) else [proc]
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def start_litellm(binary: str, fake: str, state: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = state / "litellm.yaml"
    config.write_text(json.dumps({"model_list": [{"model_name": "prorl-fake-byte", "litellm_params": {
        "model": "openai/prorl-fake-byte", "api_base": f"{fake}/v1", "api_key": "none"}}],
        "litellm_settings": {"drop_params": True, "telemetry": False}}))
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MASTER_KEY": "sk-bench"}
    log = open(state / "litellm.log", "wb")
    proc = subprocess.Popen([binary, "--config", str(config), "--port", str(port), "--num_workers", "1"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return requests.get(f"{url}/health/liveliness", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    wait_for(up, 180, "the LiteLLM proxy")
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "serve"])
    parser.add_argument("--sessions", default="1,256", help="Concurrent sessions, comma-separated (serve: one number).")
    parser.add_argument("--calls", type=int, default=4, help="Calls per session.")
    parser.add_argument("--rounds", type=int, default=2, help="Runs of each path at each concurrency (best kept).")
    parser.add_argument("--litellm", default=None, help="The LiteLLM proxy's `litellm` binary (its own venv).")
    parser.add_argument("--host-processes", type=int, default=1,
                        help="Gateway host processes the sessions are spread over (the run workers of a node: "
                             "PRORL_RUN_WORKER_PROCESSES).")
    parser.add_argument("--latency-model", default="none",
                        help="The fake server's latency model: none (the stress case), realistic (REALISTIC) "
                             "or a spec of its own (step_s=...,capacity=...).")
    args = parser.parse_args()
    if args.mode == "serve":
        args.sessions = int(args.sessions)
        serve(args)
        return
    state = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    (state / "script.json").write_text(json.dumps(SCRIPT))
    stack = Stack(StackOptions(redis_password=REDIS_PASSWORD, state_dir=state, persist=False, beat=False))
    stack.start_redis(REDIS_PORT)
    try:
        latency = REALISTIC if args.latency_model == "realistic" else args.latency_model
        print(f"latency model: {latency}; load average at the start: {os.getloadavg()}", flush=True)
        fake = stack.start_fake_llm(extra_args=["--policy", f"scripted:{state / 'script.json'}", "--latency-model",
                                                latency, "--max-model-len", "100000"])
        stack.register_llm(fake, protocol="generate", dialect="fake", capacity=100000)
        litellm = start_litellm(os.path.expanduser(args.litellm), fake, state) if args.litellm else None
        rows = []
        for n in [int(x) for x in args.sessions.split(",")]:
            counts = [n // args.host_processes + (i < n % args.host_processes) for i in range(args.host_processes)]
            hosts = [subprocess.Popen([sys.executable, __file__, "serve", "--sessions", str(c)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True,
                                      env={**stack.env(), "PRORL_BENCH_REDIS_URL": stack.redis_url})
                     for c in counts if c]
            gateways = [tuple(x) for host in hosts for x in json.loads(host.stdout.readline())]
            gateways = [gateways[i] for i in _interleaved(counts)]  # each host's sessions spread over the run
            paths = {"direct": ([(f"{fake}/v1", "none")] * n, None),
                     "gateway": ([(f"{u}/v1", k) for u, k in gateways], [psutil.Process(h.pid) for h in hosts])}
            if litellm:
                paths["litellm"] = ([(f"{litellm[1]}/v1", "sk-bench")] * n, psutil.Process(litellm[0].pid))
            run_path(paths["gateway"][0][:1], 1, None)  # warm: tokenizer, connections
            for name, (targets, proc) in paths.items():
                runs = [run_path(targets, args.calls, proc) for _ in range(args.rounds)]
                best = min(runs, key=lambda r: r["p50_ms"])
                rows.append((n, name, best))
            for host in hosts:
                host.stdin.close()
            for host in hosts:
                host.wait(30)
        report(rows)
        breakdown(stack.redis_url)
    finally:
        if args.litellm and litellm:
            litellm[0].terminate()
            litellm[0].wait(30)
        stack.stop()


def _interleaved(counts: list[int]) -> list[int]:
    """Indices into the hosts' concatenated session lists, taking one of each host in turn."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    out = []
    for j in range(max(counts, default=0)):
        out += [starts[i] + j for i, c in enumerate(counts) if j < c]
    return out


def breakdown(url: str) -> None:
    """Where a gateway call's time went, from its records on the rollout store: the gateway's own
    share, the pool's."""
    import redis

    from prorl_celery.rollout.store import Call

    client = redis.Redis.from_url(url)
    calls = [Call.unpack(raw) for key in client.scan_iter(keys.rollout_calls("bench-*"))
             for raw in client.lrange(key, 0, -1)]
    if calls:
        own = statistics.median(c.meta["gateway"]["gateway_s"] for c in calls) * 1000
        pool = statistics.median(c.meta["latency_s"] for c in calls) * 1000
        print(f"gateway records: {len(calls)}; median own {own:.2f} ms, median pool.generate {pool:.2f} ms")


def report(rows: list[tuple[int, str, dict[str, float]]]) -> None:
    print(f"load average before the summary: {os.getloadavg()}")
    print(f"{'sessions':>8} {'path':<8} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9} {'CPU ms/call':>12}")
    for n, name, r in rows:
        print(f"{n:>8} {name:<8} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['calls_per_s']:9.1f} {r['cpu_ms_per_call']:12.2f}")
    for n in sorted({n for n, _, _ in rows}):
        by = {name: r for m, name, r in rows if m == n}
        direct, gw = by["direct"], by["gateway"]
        line = (f"sessions={n} added_p50_ms={gw['p50_ms'] - direct['p50_ms']:.2f} "
                f"throughput_ratio={gw['calls_per_s'] / direct['calls_per_s']:.2f}")
        if "litellm" in by:
            lt = by["litellm"]
            line += (f" litellm_added_p50_ms={lt['p50_ms'] - direct['p50_ms']:.2f} "
                     f"litellm_throughput_ratio={lt['calls_per_s'] / direct['calls_per_s']:.2f}")
        print(line)


if __name__ == "__main__":
    main()
