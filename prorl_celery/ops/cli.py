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


_NO_TOKEN = ("refusing to serve the API without a token, on loopback too (any local user or a "
             "sandbox could reach it): set PRORL_API_TOKEN (`prorl-celery up` generates one)")
_DEMO_BANNER = """
  ******************************************************************************************
  *  bubblewrap does not work on this machine: the demo's sandboxes run WITHOUT ISOLATION   *
  *  (runtime 'local', as this user). Fine for the built-in fake policy; never for a model. *
  *  Install bubblewrap (scripts/install-system-deps.sh) for isolated sandboxes.            *
  ******************************************************************************************
"""


def _serve_options(threads: int | None) -> dict:
    """The API server's options (:func:`prorl_celery.ops.serve.make_server`): ``api_threads`` for
    ordinary requests plus one thread per long-lived request the stream limiter lets in, so
    streams and long polls never take the threads that /healthz and submissions need; connections
    capped in total (within the open files limit) and per client, and a deadline for a request's
    head, so that idle connections cannot keep /healthz from answering."""
    import resource

    from config.settings import get_settings

    settings = get_settings()
    total = (threads or settings.api_threads) + settings.api_max_streams
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    spare = files - total - 256 if files != resource.RLIM_INFINITY else settings.api_max_connections
    return {"threads": total, "connection_limit": max(64, min(settings.api_max_connections, spare)),
            "max_per_client": settings.api_max_connections_per_client,
            "header_timeout_s": settings.api_header_timeout_s, "channel_timeout": settings.api_idle_timeout_s,
            "asyncore_use_poll": True, "ident": "prorl-celery"}


def _cmd_api(args: argparse.Namespace) -> int:
    from config.settings import get_settings
    from flask_api import create_app
    from prorl_celery.ops.serve import make_server

    if not get_settings().api_token:
        print(_NO_TOKEN, file=sys.stderr)
        return 2
    from prorl_celery.connections import check_store_layout
    from prorl_celery.errors import StoreLayoutMismatch

    try:
        check_store_layout()
    except StoreLayoutMismatch as exc:
        print(f"refusing to serve: {exc}", file=sys.stderr)
        return 2
    _raise_open_files_limit()  # before the options: the connection limit fits what it allows
    from celery._state import _set_task_join_will_block

    # The API never waits on a task's result (it reads the job store), as a worker never does:
    # so marked, a chain it sends subscribes to no result channel (Celery's send_task otherwise
    # sends a SUBSCRIBE per job, and an UNSUBSCRIBE once its AsyncResult is dropped).
    _set_task_join_will_block(True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = make_server(create_app(), host=args.host, port=args.port, reuse_port=args.reuse_port,
                         **_serve_options(args.threads))
    print(f"api listening on http://{args.host}:{args.port}", flush=True)
    server.run()
    return 0


def _raise_open_files_limit() -> None:
    """Each stream holds a socket and may hold a Redis connection: lift the soft limit to the hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _cmd_sandbox_host(args: argparse.Namespace) -> int:
    from sandboxes.host import main as host

    return host.main(args) or 0


def _cmd_fake_llm(args: argparse.Namespace) -> int:
    from prorl_celery.fakes.llm import server as fake_server

    return fake_server.main(args)


def _up_env(args: argparse.Namespace, demo_dir: Path) -> dict[str, str]:
    """Extra environment of the stack: ``--dev`` allows the ``local`` runtime (no isolation); so
    does ``--demo`` on a machine where bubblewrap does not work, behind a banner. ``--demo`` also
    allows its own fixture directory as a repository source (the operator who asked for the demo
    asked for its SWE job), beside whatever ``PRORL_REPO_SOURCE_DIRS`` already allows."""
    env = {}
    if args.dev:
        env["PRORL_ALLOW_LOCAL_RUNTIME"] = "1"
    if args.harbor_dir:  # Harbor task folders the operator allows, beside PRORL_HARBOR_TASK_DIRS's
        allowed = os.environ.get("PRORL_HARBOR_TASK_DIRS", "")
        env["PRORL_HARBOR_TASK_DIRS"] = ",".join(filter(None, [allowed, *map(os.path.abspath, args.harbor_dir)]))
    if args.demo:
        allowed = os.environ.get("PRORL_REPO_SOURCE_DIRS", "")
        env["PRORL_REPO_SOURCE_DIRS"] = ",".join(filter(None, [allowed, str(demo_dir)]))
        from sandboxes.runtimes.bwrap import bwrap_works

        if not args.dev and not bwrap_works():
            env["PRORL_ALLOW_LOCAL_RUNTIME"] = "1"
            print(_DEMO_BANNER, flush=True)
    return env


def _cmd_up(args: argparse.Namespace) -> int:
    from prorl_celery.ops.launcher import Stack, StackOptions, masked
    from prorl_celery.ops.sizing import SizingError, parse_concurrency
    from prorl_celery.statedir import UnsafeStateDir

    try:
        overrides = {k: v for text in args.concurrency or [] for k, v in parse_concurrency(text).items()}
    except SizingError as exc:
        print(f"--concurrency {exc}", file=sys.stderr)
        return 2
    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="prorl-up-")).absolute()
    try:
        stack = Stack(StackOptions(state_dir=state_dir, redis_url=args.redis_url, host=args.host,
                                   port=args.port, env=_up_env(args, state_dir / "demo"),
                                   redis_bind=args.redis_bind,
                                   api_token=os.environ.get("PRORL_API_TOKEN") or None,
                                   concurrency_overrides=overrides, store_shards=args.store_shards,
                                   routing_redis=args.routing_redis, api_processes=args.api_processes))
    except UnsafeStateDir as exc:
        print(f"refusing the state directory: {exc}", file=sys.stderr)
        return 2
    print(f"workers: {stack.plan.line()}; sandbox capacity {stack.plan.sandbox_capacity}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting prorl-celery (state and logs in {state_dir}) ...", flush=True)
    try:
        try:
            stack.start()
        except RuntimeError as exc:  # a part exited or never answered: its own words say why
            print(f"prorl-celery up: could not start: {exc}", file=sys.stderr, flush=True)
            return 1
        print(f"redis   {masked(stack.redis_url)}", flush=True)
        for url in stack.shard_urls:
            print(f"shard   {masked(url)}", flush=True)
        if stack.routing_url:
            print(f"routing {masked(stack.routing_url)}", flush=True)
        print(f"api     {stack.api_url}", flush=True)
        print(f"secrets {stack.secrets_path}   (0600: PRORL_API_TOKEN, PRORL_REDIS_URL with the "
              f"password; clients read it with PRORL_STATE_DIR={state_dir})", flush=True)
        if not args.redis_url:  # the private Redis of the state directory: what an earlier run left
            for bid, address, error in stack.drop_dead_backends():
                print(f"llm     {address} id={bid} dropped: registered by an earlier run, no answer now "
                      f"({error})", flush=True)
        if args.fake_llm or not (args.llm or args.no_fake_llm):
            url = stack.start_fake_llm(extra_args=["--latency-model", "step_s=0.005,capacity=64",
                                                   "--policy", "oracle:prorl_celery.fakes.oracle:reply"])
            print(f"llm     {url} (fake: test and demo tool) id={stack.register_llm(url)}", flush=True)
        for url in args.llm or []:
            print(f"llm     {url} id={stack.register_llm(url)}", flush=True)
        print("ready", flush=True)
        if args.demo:
            from prorl_celery.ops.demo import run_demo

            from prorl_celery.ops.demo import DemoFailed

            try:
                run_demo(stack.api_url, stop, token=stack.api_token, work_dir=state_dir / "demo")
            except DemoFailed as exc:
                print(f"demo failed: {exc} (logs in {stack.log_dir})", file=sys.stderr, flush=True)
                return 1
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
    from prorl_celery.ops.sizing import plan

    print(f"\n`prorl-celery up` would start (threads per worker): {plan(current).line()}")
    _print_live_workers()
    return 0


def _print_live_workers() -> None:
    """What the running workers hold, when the configured Redis answers within a second."""
    import redis

    from config.settings import get_settings

    try:  # first a bounded ping: Celery would retry a missing broker for many seconds
        redis.Redis.from_url(get_settings().redis_url, socket_connect_timeout=1, socket_timeout=1).ping()
    except redis.RedisError as exc:
        print(f"running workers: unknown (Redis: {type(exc).__name__})")
        return
    try:
        from prorl_celery.workers import worker_threads

        live = worker_threads(timeout=1.0)
    except Exception as exc:  # noqa: BLE001 - no broker here: the plan above is all there is
        print(f"running workers: unknown ({type(exc).__name__})")
        return
    for queue, workers in live.items():
        held = ", ".join(f"{name}={threads}" for name, threads in workers.items()) or "-"
        print(f"running workers on {queue}: {held}")


def _load_secrets(state_dir: str | None) -> None:
    """PRORL_REDIS_URL and PRORL_API_TOKEN from ``<state dir>/secrets.env`` where the environment
    does not set them (before the settings are first read)."""
    from prorl_celery.statedir import read_secrets

    if state_dir:
        for key, value in read_secrets(state_dir).items():
            if key in ("PRORL_REDIS_URL", "PRORL_API_TOKEN") and not os.environ.get(key):
                os.environ[key] = value


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    _load_secrets(args.state_dir)
    from prorl_celery.connections import get_store
    from prorl_celery.ops.report import render, snapshot

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
    up.add_argument("--dev", action="store_true",
                    help="development: allow the 'local' sandbox runtime (NO isolation; PRORL_ALLOW_LOCAL_RUNTIME=1)")
    up.add_argument("--redis-bind", default="127.0.0.1",
                    help="addresses the private Redis listens on (default loopback; it always needs its password)")
    up.add_argument("--harbor-dir", action="append", metavar="DIR",
                    help="allow the Harbor task folders beneath DIR (repeatable; PRORL_HARBOR_TASK_DIRS)")
    up.add_argument("--concurrency", action="append", metavar="QUEUE=N[,QUEUE=N]",
                    help="threads of each queue's worker, e.g. run=1050,init=64 (repeatable); "
                         "unnamed queues follow the settings (see `prorl-celery settings`)")
    up.add_argument("--store-shards", type=int, default=0, metavar="N",
                    help="start N Redis of their own for the rollouts' records (0: the head's Redis holds them); "
                         "README 'Running the parts yourself' says how many for how many rollouts")
    up.add_argument("--routing-redis", action="store_true",
                    help="start a Redis of its own (appendfsync everysec) for the LLM routing's leases, sessions "
                         "and registry: its two writes per turn leave the head's fsync (PRORL_ROUTING_URL)")
    up.add_argument("--api-processes", type=int, default=1, metavar="K",
                    help="API processes on the one port (SO_REUSEPORT)")
    up.set_defaults(func=_cmd_up)

    api = sub.add_parser("api", help="serve the HTTP API (needs PRORL_REDIS_URL)")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument("--threads", type=int, default=None,
                     help="concurrent requests (a long poll or /process holds one); default: settings.api_threads")
    api.add_argument("--reuse-port", action="store_true",
                     help="listen with SO_REUSEPORT: several `api` processes on one port share its connections")
    api.set_defaults(func=_cmd_api)

    status = sub.add_parser("status", help="queues, workers, sandbox hosts, LLM backends, jobs by status")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument("--state-dir", default=os.environ.get("PRORL_STATE_DIR"),
                        help="read PRORL_REDIS_URL from <state dir>/secrets.env unless set")
    status.set_defaults(func=_cmd_status)

    conf = sub.add_parser("settings", help="list every PRORL_* setting with its default")
    conf.set_defaults(func=_cmd_settings)

    from sandboxes.host import main as host

    box = sub.add_parser("sandbox-host", help="serve sandboxes on this node")
    host.add_arguments(box)
    box.set_defaults(func=_cmd_sandbox_host)

    from prorl_celery.fakes.llm import server as fake_server

    fake = sub.add_parser("fake-llm", help="serve a fake LLM (test and demo tool, runs no model)")
    fake_server.add_arguments(fake)
    fake.set_defaults(func=_cmd_fake_llm)

    from prorl_celery.ops import audit_cli, harbor_cli, projects_cli

    harbor_cli.add_parser(sub)
    projects_cli.add_parser(sub)
    audit_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
