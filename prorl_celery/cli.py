"""``prorl-celery``: run the service (``up``), or one of its parts (``api``, ``sandbox-host``)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def _cmd_api(args: argparse.Namespace) -> int:
    import waitress

    from config.settings import get_settings
    from flask_api import create_app

    if not _loopback(args.host) and not get_settings().api_token:
        print(f"refusing to listen on {args.host} without a token: set PRORL_API_TOKEN", file=sys.stderr)
        return 2

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"api listening on http://{args.host}:{args.port}", flush=True)
    threads = args.threads or get_settings().api_threads
    waitress.serve(create_app(), host=args.host, port=args.port, threads=threads,
                   connection_limit=max(100, threads + 64), channel_timeout=900, ident="prorl-celery")
    return 0


def _cmd_sandbox_host(args: argparse.Namespace) -> int:
    from sandboxes import host

    return host.main(args) or 0


def _cmd_fake_llm(args: argparse.Namespace) -> int:
    from prorl_celery.llm import fake_server

    return fake_server.main(args)


def _cmd_up(args: argparse.Namespace) -> int:
    from prorl_celery.launcher import Stack, StackOptions

    import secrets

    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="prorl-up-"))
    env = {}
    token = os.environ.get("PRORL_API_TOKEN")
    if not token and not _loopback(args.host):
        token = env["PRORL_API_TOKEN"] = secrets.token_urlsafe(24)
    stack = Stack(StackOptions(state_dir=state_dir, redis_url=args.redis_url, host=args.host,
                               port=args.port, env=env))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting prorl-celery (state and logs in {state_dir}) ...", flush=True)
    try:
        stack.start()
        print(f"redis   {stack.redis_url}", flush=True)
        print(f"api     {stack.api_url}", flush=True)
        if args.fake_llm or not (args.llm or args.no_fake_llm):
            url = stack.start_fake_llm(extra_args=["--latency-model", "step_s=0.005,capacity=64",
                                                   "--policy", "oracle:tasks.fixtures.oracle:reply"])
            print(f"llm     {url} (fake: test and demo tool) id={stack.register_llm(url)}", flush=True)
        for url in args.llm or []:
            print(f"llm     {url} id={stack.register_llm(url)}", flush=True)
        if token:
            print(f"token   {token}   (send 'Authorization: Bearer <token>')", flush=True)
        print("ready", flush=True)
        if args.demo:
            from prorl_celery.demo import run_demo

            run_demo(stack.api_url, stop, token=token, work_dir=state_dir / "demo")
            if not args.stay:
                return 0
        stop.wait()
    finally:
        print("stopping ...", flush=True)
        stack.stop()
        print("stopped", flush=True)
    return 0


def _cmd_settings(args: argparse.Namespace) -> int:
    from config.settings import Settings, get_settings

    current = get_settings()
    for name, info in Settings.model_fields.items():
        value = getattr(current, name)
        marker = "" if value == info.default else f"   (now: {value!r})"
        print(f"PRORL_{name.upper():<22} {info.default!r:<28} {info.description}{marker}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from prorl_celery.connections import get_store
    from prorl_celery.report import render, snapshot

    snap = snapshot(get_store())
    print(json.dumps(snap, indent=2) if args.json else render(snap))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prorl-celery", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start Redis (unless given), sandbox host, workers, beat and the API")
    up.add_argument("--host", default="127.0.0.1", help="interface the API listens on")
    up.add_argument("--port", type=int, default=8000, help="API port (0: any free port)")
    up.add_argument("--redis-url", default=None, help="use this Redis instead of a private one")
    up.add_argument("--state-dir", default=os.environ.get("PRORL_STATE_DIR"),
                    help="where the private Redis keeps its data and where logs go")
    up.add_argument("--fake-llm", action="store_true",
                    help="start a fake LLM server (test and demo tool) and register it")
    up.add_argument("--llm", action="append", metavar="URL",
                    help="register this LLM server (OpenAI-compatible chat); repeatable")
    up.add_argument("--no-fake-llm", action="store_true",
                    help="without --llm: start no fake LLM (by default one is started and registered)")
    up.add_argument("--demo", action="store_true", help="submit a handful of jobs and show them run")
    up.add_argument("--stay", action="store_true", help="with --demo: keep running afterwards")
    up.set_defaults(func=_cmd_up)

    api = sub.add_parser("api", help="serve the HTTP API (needs PRORL_REDIS_URL)")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument("--threads", type=int, default=None,
                     help="concurrent requests (a long poll or /process holds one); default: settings.api_threads")
    api.set_defaults(func=_cmd_api)

    status = sub.add_parser("status", help="queues, workers, sandbox hosts, LLM backends, jobs by status")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.set_defaults(func=_cmd_status)

    conf = sub.add_parser("settings", help="list every PRORL_* setting with its default")
    conf.set_defaults(func=_cmd_settings)

    from sandboxes import host

    box = sub.add_parser("sandbox-host", help="serve sandboxes on this node")
    host.add_arguments(box)
    box.set_defaults(func=_cmd_sandbox_host)

    from prorl_celery.llm import fake_server

    fake = sub.add_parser("fake-llm", help="serve a fake LLM (test and demo tool, runs no model)")
    fake_server.add_arguments(fake)
    fake.set_defaults(func=_cmd_fake_llm)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
