"""``/healthz`` while one client holds thousands of idle connections, the API served two ways side
by side on one private Redis: ``before``, waitress with the options the API had before (768
threads, ``connection_limit`` 1,024, ``channel_timeout`` 900 s), and ``after``, ``prorl-celery api``
as it serves now (``prorl_celery/ops/serve.py``: a per-client cap, a deadline for a request's head).

Both run beside one worker per queue (init, run, eval), so ``/healthz`` asks real workers.
For each: N sockets from 127.0.0.2 connect (non-blocking) and never send a byte; after a settle
time, ``GET /healthz`` from 127.0.0.1, timed to the answer or to ``--limit`` seconds; then again
after the sockets are closed (the baseline).

    python bench/idle_connections.py [--idle 2000] [--limit 20]

Last line: ``idle=<N> before_s=<s or >limit> after_s=<s> goal_1s=<met|not met>``.
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.private import REDIS_PORT  # noqa: E402  (sets the environment)

import requests  # noqa: E402

from prorl_celery.ops.launcher import Stack, StackOptions  # noqa: E402
from prorl_celery.ops.procs import Child, free_port, wait_for  # noqa: E402

BEFORE = """
import waitress
from flask_api import create_app
waitress.serve(create_app(), host="127.0.0.1", port={port}, threads=768, connection_limit=1024,
               asyncore_use_poll=True, channel_timeout=900, ident="prorl-celery")
"""


def _workers(url: str) -> int:
    try:
        return sum(requests.get(f"{url}/healthz", timeout=5).json()["workers"].values())
    except (requests.RequestException, ValueError, KeyError):
        return 0


def start(kind: str, stack: Stack, log_dir: Path) -> tuple[Child, str]:
    port = free_port()
    argv = ([sys.executable, "-c", BEFORE.format(port=port)] if kind == "before" else
            [sys.executable, "-m", "prorl_celery.ops.cli", "api", "--port", str(port)])
    child = Child(f"api-{kind}", argv, stack.env(), log_dir).start()
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _workers(url) >= 3, 60, f"the API ({kind}) and its workers", child=child)
    return child, url


def healthz_s(url: str, limit: float) -> float | None:
    started = time.monotonic()
    try:
        requests.get(f"{url}/healthz", timeout=limit)
    except requests.RequestException:
        return None
    return time.monotonic() - started


def measure(url: str, idle: int, limit: float, settle: float) -> tuple[float | None, float | None]:
    port = int(url.rsplit(":", 1)[1])
    socks = []
    for _ in range(idle):
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind(("127.0.0.2", 0))
        sock.connect_ex(("127.0.0.1", port))
        socks.append(sock)
    time.sleep(settle)
    held = healthz_s(url, limit)
    for sock in socks:
        sock.close()
    time.sleep(settle)
    return held, healthz_s(url, limit)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle", type=int, default=2000)
    parser.add_argument("--limit", type=float, default=20.0, help="longest wait for /healthz, seconds")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds between connecting and probing")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.idle + 1024)), hard))
    state = Path(tempfile.mkdtemp(prefix="bench-idle-"))
    stack = Stack(StackOptions(state_dir=state, persist=False, concurrency={"init": 1, "run": 1, "eval": 1},
                               beat=False))
    stack.start_redis(REDIS_PORT)
    figures = {}
    try:
        for queue in ("init", "run", "eval"):
            stack.start_worker(queue)
        for kind in ("before", "after"):
            child, url = start(kind, stack, state)
            try:
                figures[kind] = measure(url, args.idle, args.limit, args.settle)
            finally:
                child.stop()
    finally:
        stack.stop()
    show = {k: tuple("> %.0f s" % args.limit if v is None else "%.3f s" % v for v in pair)
            for k, pair in figures.items()}
    print(f"load average {os.getloadavg()[0]:.2f}; {args.idle} idle connections from 127.0.0.2")
    for kind, (held, free) in show.items():
        print(f"{kind:>7}: /healthz with them held {held:>10}   after they closed {free:>10}")
    after = figures["after"][0]
    print(f"idle={args.idle} before_s={show['before'][0].replace(' ', '')} after_s={show['after'][0].replace(' ', '')} "
          f"goal_1s={'met' if after is not None and after < 1.0 else 'not met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
