"""Bring the whole service up on one machine: Redis, a sandbox host, one worker per queue, beat and
the API; and take it all down again. ``prorl-celery up`` and the test suite both use it.

Every stack is authenticated, loopback included: it generates an API token and a Redis password
(unless given), hands them to its children through the environment (never argv: ``ps`` shows argv
to every local user) and keeps them in ``<state dir>/secrets.env`` (0600, in a 0700 directory).
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import signal
import socket
import threading
import time
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis
import requests

from config.settings import get_settings

from prorl_celery import keys
from prorl_celery.ops import sizing
from prorl_celery.ops.procs import Child, free_port, wait_for
from prorl_celery.ops.redis_server import PASSWORD_ENV, redis_server_binary  # noqa: F401 - re-exported
from prorl_celery.statedir import make_private_dir, write_secrets

log = logging.getLogger(__name__)
# how long a part of the stack (a Redis, the sandbox host, the API) may take to come up: seconds on
# an idle node, tens of seconds at load 50+ (a test session saw 20 s run out); a dead child fails at once
START_WAIT_S = 90


def masked(url: str) -> str:
    """``url`` with its password replaced by ``***``: for printing and logs."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


@dataclass
class StackOptions:
    state_dir: Path
    redis_url: str | None = None
    api_token: str | None = None  # generated when not given
    redis_password: str | None = None  # for the private Redis; generated when not given
    redis_bind: str = "127.0.0.1"
    host: str = "127.0.0.1"
    port: int = 0
    concurrency: dict[str, int] | None = None  # exactly these queues and threads; None: the plan
    concurrency_overrides: dict[str, int] = field(default_factory=dict)  # up --concurrency
    env: dict[str, str] = field(default_factory=dict)
    beat: bool = True
    persist: bool = True
    store_shards: int = 0  # Redis instances of their own for the rollouts (prorl_celery/shards.py); 0: the head's
    routing_redis: bool = False  # a Redis of its own for the LLM routing (prorl_celery/llm/store.py)
    api_processes: int = 1  # API processes on one port (SO_REUSEPORT: the kernel spreads connections)


class Stack:
    """The service's processes, started in dependency order and stopped in reverse."""

    def __init__(self, options: StackOptions):
        self.options = options
        self.plan = sizing.plan(sizing.settings_with(options.env),
                                options.concurrency or options.concurrency_overrides)
        self.concurrency = dict(self.plan.concurrency if options.concurrency is None
                                else options.concurrency)
        self.state_dir = make_private_dir(Path(options.state_dir))
        self.log_dir = make_private_dir(self.state_dir / "logs")
        self.children: dict[str, Child] = {}
        self.redis_url = options.redis_url or ""
        self.shard_urls: list[str] = []
        self.routing_url = ""
        self.redis_password = options.redis_password or secrets.token_urlsafe(24)
        self.api_token = options.api_token or secrets.token_urlsafe(24)
        self.api_url = ""
        self.restarts: dict[str, int] = {}
        self._paused: set[str] = set()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    # -- environment ----------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.options.env)
        env["PRORL_REDIS_URL"] = self.redis_url
        if self.shard_urls:
            env["PRORL_STORE_SHARDS"] = ",".join(self.shard_urls)
        if self.routing_url:
            env["PRORL_ROUTING_URL"] = self.routing_url
        env["PRORL_API_TOKEN"] = self.api_token
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    @property
    def secrets_path(self) -> Path:
        return self.state_dir / "secrets.env"

    def write_secrets(self) -> Path:
        """``<state dir>/secrets.env`` (0600): what a client or ``prorl-celery status`` needs."""
        values = {"PRORL_API_TOKEN": self.api_token, "PRORL_REDIS_URL": self.redis_url}
        if self.shard_urls:
            values["PRORL_STORE_SHARDS"] = ",".join(self.shard_urls)
        if self.routing_url:
            values["PRORL_ROUTING_URL"] = self.routing_url
        if self.api_url:
            values["PRORL_API_URL"] = self.api_url
        return write_secrets(self.state_dir, values)

    def _child(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, env or self.env(), self.log_dir).start()
        self.children[name] = child
        return child

    # -- the parts ------------------------------------------------------------------------
    def start_redis(self, port: int | None = None) -> None:
        """The hardened private Redis (see :mod:`prorl_celery.ops.redis_server`): password from the
        environment, dangerous commands off, run as an unprivileged user when this is root."""
        self.redis_url = self._start_redis_server("redis", port)
        self.write_secrets()

    def start_store_shards(self, n: int) -> list[str]:
        """``n`` Redis of their own for the rollouts (redis-shard-1 ...), hardened as the head's and
        persisted with ``appendfsync everysec`` (a turn's append is not fsynced alone: a crash may
        lose its last second, which the next save sends again, prorl_celery/shards.py); every
        process started after this gets them in ``PRORL_STORE_SHARDS``."""
        self.shard_urls = [self._start_redis_server(f"redis-shard-{i + 1}", fsync="everysec") for i in range(n)]
        if self.redis_url:
            self.write_secrets()
        return self.shard_urls

    def start_routing_redis(self, port: int | None = None) -> str:
        """A Redis of its own for the LLM routing (redis-routing), hardened as the head's and
        persisted with ``appendfsync everysec``: its leases, sessions and stickiness lapse by
        design, and the two writes of each turn's routing no longer wait for the head's fsync
        (prorl_celery/llm/store.py); every process started after this gets ``PRORL_ROUTING_URL``."""
        self.routing_url = self._start_redis_server("redis-routing", port, fsync="everysec")
        if self.redis_url:
            self.write_secrets()
        return self.routing_url

    def _start_redis_server(self, name: str, port: int | None = None, fsync: str = "always") -> str:
        port = port or free_port()
        # the head's: fsync on every write: a job the API accepted survives even a kill -9 of Redis
        argv = [sys.executable, "-m", "prorl_celery.ops.redis_server", "--port", str(port),
                "--bind", self.options.redis_bind, "--dir", str(self.state_dir / name),
                "--appendfsync", fsync if self.options.persist else "no", *self._memory_share()]
        child = self._child(name, argv, {**self.env(), PASSWORD_ENV: self.redis_password})
        url = f"redis://:{self.redis_password}@127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url)
        wait_for(lambda: _pings(client), START_WAIT_S, name, child=child)
        return url

    def _memory_share(self) -> list[str]:
        """With store shards on this node and no ``redis_maxmemory_mb`` set, the head's Redis and
        each shard cap at an equal share of the default (half the node's memory), not each at all of it."""
        from prorl_celery.ops.redis_server import default_maxmemory_mb

        n = 1 + max(self.options.store_shards, len(self.shard_urls)) + bool(self.options.routing_redis or self.routing_url)
        if n == 1 or sizing.settings_with(self.options.env).redis_maxmemory_mb:
            return []
        return ["--maxmemory-mb", str(max(64, default_maxmemory_mb() // n))]

    def restart_redis(self, sig: int = signal.SIGKILL, name: str = "redis", down_s: float = 0.0) -> None:
        """Kill the private Redis ``name`` (the head's, or a store shard: redis-shard-1 ...), by
        default without letting it save, leave it down ``down_s`` and start it again on the same
        port and data directory."""
        self._paused.add(name)
        try:
            old = self.children[name]
            old.signal(sig)
            old.popen.wait()
            time.sleep(down_s)
            child = self._child(name, old.argv, old.env)
            port = old.argv[old.argv.index("--port") + 1]
            client = redis.Redis(port=int(port), password=self.redis_password)
            wait_for(lambda: _pings(client), START_WAIT_S, f"{name} to restart", child=child)
        finally:
            self._paused.discard(name)

    # -- supervision ----------------------------------------------------------------------
    def supervise(self, period_s: float = 1.0) -> None:
        """Restart, in the background, any part of the stack that exits while the stack runs."""
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, args=(period_s,), daemon=True,
                                                name="stack-supervisor")
            self._supervisor.start()

    def _supervise(self, period_s: float) -> None:
        while not self._stopping.wait(period_s):
            for name, child in list(self.children.items()):
                if name in self._paused or child.alive() or self._stopping.is_set():
                    continue
                if self.children.get(name) is not child:
                    continue  # replaced meanwhile (restart_redis)
                code = child.popen.returncode if child.popen else None
                log.warning("%s exited (status %s); restarting it", name, code)
                self.restarts[name] = self.restarts.get(name, 0) + 1
                self.children[name] = Child(name, child.argv, child.env, self.log_dir).start()

    def pause_supervision(self, name: str) -> None:
        """Leave ``name`` dead if it exits (a test that stops it on purpose)."""
        self._paused.add(name)

    def start_sandbox_host(self, name: str = "sandbox-host") -> Child:
        client = redis.Redis.from_url(self.redis_url)
        before = client.zcard(keys.hosts())
        # A host id stable for this state directory: a restarted stack's host finds and wipes
        # the workspaces its predecessor left behind.
        digest = hashlib.sha1(str(self.state_dir.resolve()).encode()).hexdigest()[:8]
        host_id = f"{socket.gethostname()}-{name}-{digest}"
        # a fixed port too: restarted by the supervisor, the host keeps its address, so handles
        # of sandboxes lost with the old process get a clean "gone" instead of a dead address
        # the Redis URL (with its password) reaches the host through PRORL_REDIS_URL, not argv
        child = self._child(name, [sys.executable, "-m", "prorl_celery.ops.cli", "sandbox-host",
                                   "--host-id", host_id, "--port", str(free_port())])
        wait_for(lambda: client.zcard(keys.hosts()) > before, START_WAIT_S, "sandbox host registration",
                 child=child)
        return child

    def start_fake_llm(self, name: str = "fake-llm", extra_args: list[str] | None = None,
                       port: int | None = None) -> str:
        """Start a fake LLM server (test and demo tool); returns its base URL once it answers."""
        port = port or free_port()
        child = self._child(name, [sys.executable, "-m", "prorl_celery.ops.cli", "fake-llm",
                                   "--port", str(port), *(extra_args or [])])
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get_ok(f"{url}/health"), START_WAIT_S, f"{name} at {url}", child=child)
        return url

    def register_llm(self, address: str, **spec) -> str:
        """Register an LLM backend in this stack's Redis; returns its id."""
        from prorl_celery.llm.models import BackendSpec
        from prorl_celery.llm.registry import BackendRegistry

        registry = BackendRegistry(*self._clients())
        backend, _ = registry.add(BackendSpec(address=address, **spec))
        return backend.id

    def drop_dead_backends(self) -> list[tuple[str, str, str]]:
        """Forget the LLM backends in this stack's Redis that no longer answer (on a state
        directory of an earlier run: the servers that run registered, its own fake LLM among
        them); ``(id, address, error)`` of each (:func:`prorl_celery.llm.health.drop_unanswering`)."""
        from prorl_celery.llm.health import drop_unanswering

        return drop_unanswering(*self._clients())

    def _clients(self) -> tuple[redis.Redis, redis.Redis]:
        """The head's Redis and the routing's, as the stack's processes see them: the one this stack
        started, else the operator's ``PRORL_ROUTING_URL``, else the head's."""
        head = redis.Redis.from_url(self.redis_url)
        url = self.routing_url or sizing.settings_with(self.options.env).routing_url
        return head, redis.Redis.from_url(url) if url else head

    def start_worker(self, queue: str, name: str | None = None, threads: int | None = None) -> Child:
        name = name or f"worker-{queue}"
        argv = [sys.executable, "-m", "celery", "-A", "prorl_celery", "worker", "-Q", queue,
                "-n", f"{name.removeprefix('worker-')}@%h", "-c",
                str(threads or self.concurrency.get(queue) or self.plan.concurrency[queue]), "--loglevel", "INFO",
                "--without-mingle", "--without-gossip"]
        return self._child(name, argv)

    def start_workers(self, queue: str) -> list[Child]:
        """The queue's worker: one process, or for ``run`` ``run_worker_processes`` of them
        (worker-run, worker-run-2, ...) sharing its threads (each holds its harness sessions'
        gateways: more processes, more cores for their per-call work)."""
        threads = self.concurrency.get(queue) or self.plan.concurrency[queue]
        processes = max(1, min(get_settings().run_worker_processes if queue == "run" else 1, threads))
        return [self.start_worker(queue, f"worker-{queue}" if i == 0 else f"worker-{queue}-{i + 1}",
                                  threads // processes + (i < threads % processes))
                for i in range(processes)]

    def start_beat(self) -> Child:
        schedule = self.state_dir / "celerybeat-schedule"
        return self._child("beat", [sys.executable, "-m", "celery", "-A", "prorl_celery", "beat",
                                    "-s", str(schedule), "--loglevel", "INFO"])

    def start_api(self) -> Child:
        """The API: one process, or ``api_processes`` of them (api, api-2 ...) listening on one
        port with SO_REUSEPORT (each its own threads and Redis pools; the kernel spreads the
        connections; every request is served whole by the one that accepted it)."""
        port = self.options.port or free_port(self.options.host)
        n = max(1, self.options.api_processes)
        argv = [sys.executable, "-m", "prorl_celery.ops.cli", "api", "--host", self.options.host,
                "--port", str(port), *(["--reuse-port"] if n > 1 else [])]
        children = [self._child("api" if i == 0 else f"api-{i + 1}", argv) for i in range(n)]
        shown = "127.0.0.1" if self.options.host in ("0.0.0.0", "::") else self.options.host
        self.api_url = f"http://{shown}:{port}"
        for child in children:
            wait_for(lambda: _get_ok(f"{self.api_url}/healthz") and child.alive(), START_WAIT_S, child.name,
                     child=child)
        return children[0]

    def wait_for_workers(self, queues, timeout: float = 60) -> None:
        def ready():
            body = _get_ok(f"{self.api_url}/healthz")
            return body and all(body["workers"].get(q, 0) >= 1 for q in queues)
        wait_for(ready, timeout, f"workers on queues {list(queues)}", pause=0.3)

    # -- whole stack ----------------------------------------------------------------------
    def start(self) -> "Stack":
        try:
            if not self.redis_url:
                self.start_redis()
            if self.options.store_shards and not self.shard_urls:
                self.start_store_shards(self.options.store_shards)
            if self.options.routing_redis and not self.routing_url:
                self.start_routing_redis()
            self.start_sandbox_host()
            for queue in self.concurrency:
                self.start_workers(queue)
            if self.options.beat:
                self.start_beat()
            self.start_api()
            self.write_secrets()
            self.wait_for_workers(self.concurrency)
            self.supervise()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop everything this stack started, at once, then Redis last."""
        self._stopping.set()
        stores = [name for name in self.children if name == "redis" or name.startswith("redis-")]
        others = [child for name, child in reversed(self.children.items()) if name not in stores]
        for child in others:
            child.signal(signal.SIGTERM)
        for child in others:
            child.stop(grace_s=5.0)
        for name in stores:
            self.children[name].stop(grace_s=10.0)
        from tasks.worker_memory import sweep_left

        sweep_left()  # the memory cgroups of run workers that were killed (a worker removes its own)

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _get_ok(url: str) -> dict | None:
    try:
        resp = requests.get(url, timeout=3)
    except requests.RequestException:
        return None
    return resp.json() if resp.status_code == 200 else None
