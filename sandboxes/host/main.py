"""The per-node sandbox host: serves sandboxes over HTTP and registers itself in Redis.

    python -m sandboxes.host.main --port 8710 --redis-url redis://head:6379/0

prints ``sandbox-host ready http://<address>`` once listening. SIGTERM or SIGINT closes every
sandbox and removes the registration; a kill -9 still takes each shell down (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

import redis
import waitress

from prorl_celery.errors import InvalidRequest, SandboxError
from sandboxes.host.advertise import advertised_url
from sandboxes.host.app import create_app, head_check
from sandboxes.host.gate import gated_channel
from sandboxes.host.loop import EpollMap, loop
from sandboxes.host.pool import SandboxPool, limit_enforcement
from sandboxes.host.registration import Registration
from sandboxes.host.reap import reap_leftovers
from sandboxes.protocol import HostRecord
from sandboxes.registry import ServedRuntimes
from sandboxes import safedirs
from sandboxes.runtimes.limits import cgroups
from sandboxes.runtimes.limits import exitboost
from sandboxes.runtimes.workspace import remove_tree

log = logging.getLogger(__name__)
_ROOTED_RUNTIMES = ("local", "bwrap", "singularity")  # runtimes that take a workspace "root"


class HostDirs:
    """``<root>/<host id>`` for each workspace root: held with a lock while the host lives, and
    emptied when it starts, which removes what a killed earlier run of the same host id left."""

    def __init__(self, host_id: str):
        self.host_id = host_id
        self.dirs: list[Path] = []
        self._locks: list[int] = []

    def claim(self, root: str) -> Path:
        path = Path(root) / self.host_id
        if path in self.dirs:
            return path
        safedirs.host_dir(root, self.host_id)  # ours and private, or the host refuses to start
        lock = safedirs.open_lock(Path(root) / f".{self.host_id}.lock")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            raise SystemExit(f"sandbox host id {self.host_id!r} is already serving from {path}")
        self._locks.append(lock)
        orphans = list(path.iterdir())
        for orphan in orphans:
            remove_tree(orphan)
        if orphans:
            log.warning("removed %d workspaces left by an earlier run of host %s", len(orphans),
                        self.host_id)
        self.dirs.append(path)
        return path

    def release(self) -> None:
        """Unlock; an empty host directory and its lock file are removed (host ids with a
        random port would otherwise pile them up)."""
        for path in self.dirs:
            try:
                path.rmdir()
                (path.parent / f".{self.host_id}.lock").unlink()
            except OSError:
                pass
        for lock in self._locks:
            os.close(lock)
        self._locks.clear()


def rooted_config(runtime_config: dict[str, dict[str, Any]], runtimes: list[str],
                  dirs: HostDirs, default_root: str) -> dict[str, dict[str, Any]]:
    """Each built-in runtime's config with its ``root`` moved under ``<root>/<host id>``."""
    out = {name: dict(cfg or {}) for name, cfg in runtime_config.items()}
    for name in _ROOTED_RUNTIMES:
        if name in runtimes or name in out:
            cfg = out.setdefault(name, {})
            cfg["root"] = str(dirs.claim(cfg.get("root") or default_root))
    return out


def advertised_address(host: str, port: int, redis_url: str | None = None) -> str:
    """What a host bound to ``host`` publishes (sandboxes/host/advertise.py: never loopback when
    bound to all interfaces and the head is elsewhere)."""
    from config.settings import get_settings

    settings = get_settings()
    return advertised_url(host, port, redis_url or settings.redis_url, settings.node_addr)


class SandboxHost:
    """A bound host: :meth:`start` registers it and starts the reaper, :meth:`run` serves
    (blocking), :meth:`shutdown` closes every sandbox and deregisters."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, redis_url: str | None = None,
                 capacity: int | None = None, token: str | None = None, host_id: str | None = None,
                 advertise: str | None = None, lease_s: float | None = None,
                 runtimes: list[str] | None = None,
                 runtime_config: dict[str, dict[str, Any]] | None = None, register: bool = True,
                 warm: int | None = None):
        from config.settings import get_settings

        settings = get_settings()
        self.token = token or secrets.token_urlsafe(24)
        try:
            self.served = ServedRuntimes(runtimes, runtime_config)
        except (SandboxError, InvalidRequest) as exc:  # nothing to serve, or local not allowed
            raise SystemExit(f"sandbox host: {exc}") from None
        self.runtimes = self.served.names
        capacity = capacity or settings.sandbox_capacity
        self.pool = SandboxPool("", capacity, lease_s or settings.sandbox_lease_s, runtime_config,
                                warm=settings.sandbox_warm if warm is None else warm,
                                served=self.served)
        app = create_app(self.pool, self.token, self.runtimes)
        self.socket_map = EpollMap()
        self.server = waitress.create_server(
            app, map=self.socket_map, host=host, port=port, threads=capacity + 8, ident="prorl-sandbox-host",
            connection_limit=max(100, 4 * capacity), channel_timeout=600, asyncore_use_poll=True,
            channel_request_lookahead=4, max_request_body_size=settings.sandbox_write_max_mb << 20)
        # each request's head judged before its body is read (no token: 401, the body never taken)
        self.server.channel_class = gated_channel(head_check(self.pool, self.token))
        self.port = self.server.effective_port
        self.address = advertise or advertised_address(host, self.port, redis_url)
        self.host_id = host_id or f"{socket.gethostname()}-{self.port}"
        self.pool.host_id = self.host_id
        self.dirs = HostDirs(self.host_id)
        default_root = settings.sandbox_root or os.path.join(tempfile.gettempdir(), "prorl-sandboxes")
        try:
            self.pool.runtime_config = rooted_config(runtime_config or {}, self.runtimes, self.dirs,
                                                     default_root)
        except BaseException:
            self.server.close()
            raise
        self.registration: Registration | None = None
        if register:
            record = HostRecord(host_id=self.host_id, address=self.address, token=self.token,
                                runtimes=self.runtimes, capacity=capacity, live=0, pid=os.getpid(),
                                auto=self.served.auto, isolation=self.served.isolation(),
                                limit_enforcement=limit_enforcement())
            client = redis.Redis.from_url(redis_url or settings.redis_url)
            self.registration = Registration(client, record, self.pool, settings.host_heartbeat_s)
            self.pool.on_change = self.registration.update_live

    def start(self) -> None:
        for path in self.dirs.dirs:  # what a killed earlier run of this host id left
            cgroups.sweep(cgroups.host_key(str(path)))
        if cgroups.controllers():
            exitboost.reset()  # a host killed during a bulk close leaves its boost behind
        reap_leftovers([p.parent for p in self.dirs.dirs], self.host_id, self.pool.runtime_config)  # dead hosts' too
        self.pool.start_reaper()
        self.pool.warm.start()
        if self.registration:
            self.registration.start()

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT, on :func:`sandboxes.host.loop.loop` (waitress's own
        ``run()`` with the loop replaced)."""
        try:
            loop(self.socket_map, self.server.adj.asyncore_loop_timeout)
        except (SystemExit, KeyboardInterrupt):
            self.server.task_dispatcher.shutdown()

    def shutdown(self) -> None:
        self.pool.stop()
        closed = self.pool.close_all()
        if self.registration:
            self.registration.remove()
        self.server.close()
        self.server.task_dispatcher.shutdown(timeout=2)
        self.dirs.release()
        log.info("sandbox host %s stopped; closed %d sandboxes", self.host_id, closed)

    def write_ready_file(self, path: str) -> None:
        info = {"address": self.address, "host_id": self.host_id, "token": self.token,
                "port": self.port, "pid": os.getpid()}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            json.dump(info, fh)
        os.replace(tmp, path)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # waitress's loop closes its sockets on SystemExit; serve() cleans up


def serve(host: str = "127.0.0.1", port: int = 0, redis_url: str | None = None,
          capacity: int | None = None, token: str | None = None, host_id: str | None = None,
          advertise: str | None = None, ready_file: str | None = None, **options: Any) -> None:
    """Serve until SIGTERM/SIGINT. ``options``: lease_s, runtimes, runtime_config, register, warm."""
    sandbox_host = SandboxHost(host, port, redis_url, capacity, token, host_id, advertise, **options)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_signal)
        signal.signal(signal.SIGINT, _exit_on_signal)
    try:
        sandbox_host.start()
        if ready_file:
            sandbox_host.write_ready_file(ready_file)
        print(f"sandbox-host ready {sandbox_host.address}", flush=True)
        log.info("sandbox host %s on %s, runtimes %s (auto: %s), capacity %d", sandbox_host.host_id,
                 sandbox_host.address, sandbox_host.runtimes, sandbox_host.served.auto,
                 sandbox_host.pool.capacity)
        sandbox_host.run()
    finally:
        sandbox_host.shutdown()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None,
                        help="Interface to bind (0.0.0.0: all; default: settings.sandbox_host_bind).")
    parser.add_argument("--port", type=int, default=0, help="Port; 0 picks a free one.")
    parser.add_argument("--redis-url", default=None, help="Where to register; default: settings.")
    parser.add_argument("--no-register", action="store_true", help="Do not register in Redis.")
    parser.add_argument("--capacity", type=int, default=None, help="Sandboxes served at once.")
    parser.add_argument("--lease-s", type=float, default=None, help="Default sandbox lease.")
    parser.add_argument("--token", default=None,
                        help="Bearer token (default: settings.host_token, $PRORL_HOST_TOKEN, or random).")
    parser.add_argument("--host-id", default=None, help="Default: <hostname>-<port>.")
    parser.add_argument("--advertise", default=None, help="Base URL clients use to reach this host.")
    parser.add_argument("--ready-file", default=None, help="Write address, token, pid here (JSON).")
    parser.add_argument("--runtimes", default=None,
                        help="Comma-separated; the host serves these and nothing else (default: "
                             "every available one; 'local' only with PRORL_ALLOW_LOCAL_RUNTIME=1).")
    parser.add_argument("--runtime-config", default=None,
                        help='JSON per runtime, e.g. \'{"local": {"root": "/scratch"}}\'.')
    parser.add_argument("--warm", type=int, default=None,
                        help="Pre-started sandboxes per runtime setting (default: settings.sandbox_warm).")
    parser.add_argument("--log-level", default="INFO")


def main(args: argparse.Namespace) -> None:
    from config.settings import get_settings
    from prorl_celery.fdlimit import raise_open_files_limit

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # five descriptors per sandbox (three pipes, a pidfd, the uid lease): a soft limit of 1024
    # stops a host at ~200 sandboxes
    raise_open_files_limit(needed=6 * (args.capacity or get_settings().sandbox_capacity) + 256)
    from sandboxes.runtimes.limits import mountns

    if mountns.separate():  # first, while single-threaded: see sandboxes/runtimes/limits/mountns.py
        log.info("workspace filesystems are mounted in the host's own mount namespace")
    serve(args.host or get_settings().sandbox_host_bind, args.port, args.redis_url, args.capacity,
          args.token or get_settings().host_token, args.host_id,
          args.advertise, args.ready_file, lease_s=args.lease_s,
          runtimes=args.runtimes.split(",") if args.runtimes else None,
          runtime_config=json.loads(args.runtime_config) if args.runtime_config else None,
          register=not args.no_register, warm=args.warm)


def cli() -> None:
    """``python -m sandboxes.host``."""
    parser = argparse.ArgumentParser(prog="python -m sandboxes.host", description=__doc__.split("\n")[0])
    add_arguments(parser)
    main(parser.parse_args())


if __name__ == "__main__":
    cli()
