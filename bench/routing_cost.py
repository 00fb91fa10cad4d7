"""The LLM routing scripts' own cost on the Redis server, counted in instructions (valgrind's
callgrind): robust where the machine is shared, as CPU time is not.

A private redis-server (no AOF) runs under callgrind; this process registers ``--backends``
backends and one job (of ``--project``, with an in-flight and a tokens-per-hour quota, or the
operator's) and calls ``Router.acquire`` + ``release`` on it, warm, ``n`` times. The server's
instructions of two runs (``--small`` and ``--small + 500`` turns) differ by 500 turns' worth: the
start and stop cancel out. Needs ``valgrind`` and the redis-server the service runs.

    python3 bench/routing_cost.py [--backends 1] [--project p] [--apart] [--new] [--turns 500]

``--new``: each turn a new rollout's first call (no sticky backend yet), then its end
(``Router.end_session``, counted in the turn). ``--full``: every backend full (capacity 1 and
another rollout's session on it): no call finds a free slot, the rollout's own backend included.
``--hours H`` (with ``--project``): the project's tokens hash holds H hours of minutes already, as
a project that has called the LLM for that long leaves it. The report adds the backend hashes read per turn
(``HMGET`` + ``HGETALL``, from ``INFO commandstats``).

``--apart``: the routing on a Redis of its own (prorl_celery/llm/store.py): the callgrind server is the
routing's, a plain second redis-server the head's (the job's record, the projects' records); the
count is the routing's Redis alone.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.private import REDIS_PORT  # noqa: E402  (sets the environment)

os.environ["PRORL_REDIS_URL"] = f"redis://127.0.0.1:{REDIS_PORT}/0"  # this private one: no password


def _answering(client: Any) -> Any:
    """``client`` (a redis.Redis) once its server answers a ping (up to ~10 s: valgrind starts slowly)."""
    import redis

    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.1)
    return client


def instructions(turns: int, backends: int, project: str, apart: bool = False,
                 new: bool = False, full: bool = False, hours: float = 0) -> tuple[int, int, int]:
    """The server's instructions for a run of ``turns`` acquire + release (warm, after 20): in all,
    and inside its commands; and the backend hashes the run read."""
    import redis

    from prorl_celery import keys
    from prorl_celery.llm.models import BackendSpec, Protocol
    from prorl_celery.llm.registry import BackendRegistry
    from prorl_celery.llm.routing import Router
    from prorl_celery.ops.redis_server import redis_server_binary

    work = tempfile.mkdtemp(prefix="routing-cost-")
    out = os.path.join(work, "callgrind.out")
    server = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", redis_server_binary(),
                               "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no", "--dir", work],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = _answering(redis.Redis(port=REDIS_PORT))
    head, head_server = client, None
    if apart:  # the head's Redis elsewhere, not counted
        from prorl_celery.ops.procs import free_port

        port = free_port()
        head_server = subprocess.Popen([redis_server_binary(), "--port", str(port), "--save", "", "--appendonly", "no",
                                        "--dir", work], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        head = _answering(redis.Redis(port=port))
    apart_kw = {"routing": client} if apart else {}  # (a base without the setting runs this script too)
    registry = BackendRegistry(head, **apart_kw)
    for i in range(backends):
        backend, _ = registry.add(BackendSpec(address=f"http://10.0.{i // 250}.{i % 250 + 1}:1",
                                              capacity=1 if full else 64, model="m", weight_version="v0", probe=False))
        if full:  # a session that never idles out
            client.zadd(keys.llm_sessions(backend.id), {"someone-else": int(time.time() * 1000) + 10 ** 9})
    job = "routing-cost-job"
    head.hset(keys.job(job), mapping={"status": "run", "project": project})
    if project:
        head.hset(keys.projects(), project, json.dumps({"weight": 1, "quotas": {
            "max_llm_in_flight": 1000, "tokens_per_hour": 10 ** 12}}))
        minute = int(time.time() // 60)
        if hours:
            client.hset(keys.llm_project_tokens(project), mapping={minute - i: 1000 for i in range(int(hours * 60))})
    router = Router(head, **apart_kw)
    for i in range(20 + turns):
        if new:
            job = f"routing-cost-job-{i}"
            head.hset(keys.job(job), mapping={"status": "run", "project": project})
        router.release(router.acquire(job, Protocol.CHAT), "ok", tokens=100)
        if new:
            router.end_session(job)
    getattr(Router, "flush_counts", lambda: 0)()  # the counters this process holds (issue 37: written every second)
    stats = client.info("commandstats")
    reads = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("hmget", "hgetall"))
    server.terminate()
    server.wait()
    if head_server:
        head_server.terminate()
        head_server.wait()
    total = int(re.search(r"^(?:summary|totals): (\d+)", Path(out).read_text(), re.M).group(1))
    return total, commands_only(out), reads


def commands_only(out: str) -> int:
    """The instructions inside ``processCommand`` (inclusive): the commands and scripts alone, without
    the event loop's timers (serverCron runs 10 times a second, so a run slowed by a loaded
    machine counts more of it) nor the sockets."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out], capture_output=True,
                          text=True, check=True).stdout
    return int(re.search(r"^\s*([\d,]+) .*:processCommand ", text, re.M).group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", type=int, default=1)
    parser.add_argument("--project", default="", help="the job's project (quotas checked); default: the operator's")
    parser.add_argument("--small", type=int, default=100)
    parser.add_argument("--turns", type=int, default=500, help="the turns the two runs differ by")
    parser.add_argument("--apart", action="store_true", help="the routing on a Redis of its own; the head's elsewhere")
    parser.add_argument("--new", action="store_true", help="each turn a new rollout's first call, and its end")
    parser.add_argument("--full", action="store_true", help="every backend full: no free slot anywhere")
    parser.add_argument("--hours", type=float, default=0, help="hours of the project's tokens already counted")
    args = parser.parse_args()
    run = (args.backends, args.project, args.apart, args.new, args.full, args.hours)
    low = instructions(args.small, *run)
    high = instructions(args.small + args.turns, *run)
    n = args.turns
    print(f"routing backends={args.backends} project={args.project or '-'} apart={int(args.apart)} "
          f"new={int(args.new)} full={int(args.full)} hours={args.hours:g} instructions_per_turn={(high[0] - low[0]) // n} in_commands={(high[1] - low[1]) // n} "
          f"backend_reads_per_turn={(high[2] - low[2]) / n:.2f}")


if __name__ == "__main__":
    main()
