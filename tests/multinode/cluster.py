"""A three-node prorl-celery cluster in network namespaces, started as an operator would.

- ``head`` (10.77.0.1): ``slurm_scripts/head.sbatch`` run by hand (Redis with its password, the
  API, beat), plus a fake LLM server bound to the head's address.
- ``node1`` (10.77.0.2): the README's "Running the parts yourself" commands: ``prorl-celery
  sandbox-host --host 0.0.0.0`` and one Celery worker per queue; no address given anywhere, so the
  host must find the one the other nodes reach it at.
- ``node2`` (10.77.0.3): ``slurm_scripts/worker_node.sh HEAD_FILE`` with its defaults but a run worker
  of two processes (``PRORL_RUN_WORKER_PROCESSES=2``; no
  ``PRORL_NODE_ADDR``: the host name "node2" resolves nowhere, the published address must not
  depend on it).
- ``client`` (10.77.0.10): where the test, as the trainer, talks to the API and Redis from.

:func:`running` builds it; given ``PRORL_STORE_SHARDS_N``, the head also runs that many store shards
(bound, as its Redis, to every interface, published at the head's address): node1 is given their
URLs as the README says, node2 reads them from the address file.

Every node has its own hostname, sandbox root (its "local disk" for workspaces) and gateway socket
directory (its own /run: a harness session on another node is relayed); the file
system is otherwise shared, as a cluster's shared file system is. The sandbox uid leases stay in
the machine's one lock directory: the nodes share one kernel, hence one uid space, and a host
that starts reaps every process of a sandbox uid whose lease nobody holds in *its* lock
directory (sandboxes/host/reap.py), so a node with a lock directory of its own would kill the other
nodes' sandboxes (and any other test's on this machine).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import redis
import requests

from tests.multinode import netns
from tests.multinode.netns import Fabric, Node
from tests.helpers import read_env_file

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "slurm_scripts"
REDIS_PORT, API_PORT, LLM_PORT = 6379, 8000, 8100
ORACLE = ["--policy", "oracle:prorl_celery.fakes.oracle:reply", "--latency-model",
          "step_s=0.002,capacity=64"]
# Fast failure detection, as the test suite's own stack uses (tests/conftest.py TEST_ENV).
SETTINGS = {
    "PRORL_SWEEP_INTERVAL_S": "1", "PRORL_STAGE_LEASE_S": "3", "PRORL_STAGE_REQUEUE_AFTER_S": "5",
    "PRORL_CONSUMER_WATCHDOG_S": "2", "PRORL_HOST_HEARTBEAT_S": "1", "PRORL_SANDBOX_WARM": "1",
    "PRORL_SANDBOX_RUNTIME": "bwrap", "PRORL_LLM_CALL_TIMEOUT_S": "20",
    "PRORL_PLUGIN_PACKAGES": "tests",  # the test handlers (tests/handlers_for_shards.py), as TEST_ENV
}
CAPACITY = 6            # sandboxes per worker node
QUEUE_THREADS = {"init": 4, "run": 8, "eval": 4, "maint": 1}


def base_env(**extra: str) -> dict[str, str]:
    """A clean environment: nothing of the test process's own (loopback) Redis or token."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(SETTINGS, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def poll(predicate: Callable[[], object], timeout: float, what: str,
         diagnose: Callable[[], str] | None = None, pause: float = 0.3) -> object:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except (requests.RequestException, redis.RedisError, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}"
                                 + (f"\n{diagnose()}" if diagnose else ""))
        time.sleep(pause)


@dataclass
class Cluster:
    fabric: Fabric
    work: Path
    head: Node = field(init=False)
    node1: Node = field(init=False)
    node2: Node = field(init=False)
    client: Node = field(init=False)
    head_file: Path = field(init=False)
    head_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.head = self.fabric.node("head", 1)
        self.node1 = self.fabric.node("node1", 2)
        self.node2 = self.fabric.node("node2", 3)
        self.client = self.fabric.node("client", 10)
        self.head_file = self.work / "prorl-head.env"
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    # -- what the head published -----------------------------------------------------------
    @property
    def api(self) -> str:
        return self.head_env["PRORL_API_URL"]

    @property
    def token(self) -> str:
        return self.head_env["PRORL_API_TOKEN"]

    @property
    def redis_url(self) -> str:
        return self.head_env["PRORL_REDIS_URL"]

    @property
    def shard_urls(self) -> list[str]:
        """The store shards the head started (``PRORL_STORE_SHARDS_N``), as its address file names them."""
        from prorl_celery.shards import parse_urls

        return parse_urls(self.head_env.get("PRORL_STORE_SHARDS"))

    def head_pids(self) -> dict[str, int]:
        """The head's components by name, as head.sbatch records them (a restarted one's latest pid)."""
        pids = {}
        for line in (self.logs / "head-local.pids").read_text().splitlines():
            name, pid = line.split()
            pids[name] = int(pid)
        return pids

    def http(self, method: str, path: str, node: Node | None = None, **kwargs) -> requests.Response:
        """An API call made from ``node`` (default: the client namespace)."""
        headers = {"Authorization": f"Bearer {self.token}", **kwargs.pop("headers", {})}
        kwargs.setdefault("timeout", 30)
        return (node or self.client).call(requests.request, method, f"{self.api}{path}",
                                          headers=headers, **kwargs)

    def submit(self, instances: list[dict]) -> list[str]:
        resp = self.http("POST", "/jobs", json={"jobs": [{"instance": i} for i in instances]})
        assert resp.status_code == 202, resp.text
        return resp.json()["job_ids"]

    def wait_all(self, ids: list[str], timeout: float) -> dict[str, dict]:
        """The views of the jobs of ``ids`` that ended within ``timeout`` seconds."""
        views: dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        for job_id in ids:
            while job_id not in views and time.monotonic() < deadline:
                resp = self.http("GET", f"/jobs/{job_id}/wait", params={"timeout": 20}, timeout=40)
                if resp.status_code == 200:
                    views[job_id] = resp.json()
        return views

    def redis(self) -> redis.Redis:
        """A client of the head's Redis. It connects lazily, in the namespace of the thread that
        first uses each connection: use it only inside ``node.call`` (from the test's own
        namespace, 10.77.0.1 is not this cluster)."""
        return redis.Redis.from_url(self.redis_url)

    def diagnose(self) -> str:
        tails = []
        for log in sorted(self.logs.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            tails.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(tails)

    # -- starting the parts ----------------------------------------------------------------
    def start_head(self, **extra: str) -> None:
        """head.sbatch run by hand (``extra``: more of its environment, e.g. ``PRORL_STORE_SHARDS_N``)."""
        env = base_env(PRORL_STATE_DIR=str(self.work / "head-state"),
                       PRORL_LOG_DIR=str(self.logs), PRORL_HEAD_FILE=str(self.head_file),
                       PRORL_HEAD_ADDR=self.head.address, PRORL_REDIS_PORT=str(REDIS_PORT),
                       PRORL_API_PORT=str(API_PORT), PRORL_FLOWER="0", PRORL_API_THREADS="32",
                       PRORL_PYTHON=sys.executable, PRORL_SLURM_DIR=str(SLURM), **extra)
        self.head.spawn("head-sbatch", ["bash", str(SLURM / "head.sbatch")], env, self.logs,
                        cwd=self.work)
        poll(self.head_file.exists, 180, "the head's address file", self.diagnose)
        self.head_env = read_env_file(self.head_file)
        llm_env = base_env(PRORL_REDIS_URL=self.redis_url)
        self.head.spawn("fake-llm", [sys.executable, "-m", "prorl_celery.ops.cli", "fake-llm",
                                     "--host", self.head.address, "--port", str(LLM_PORT), *ORACLE],
                        llm_env, self.logs)
        poll(lambda: self.client.call(requests.get, f"{self.llm_url}/health", timeout=3).ok, 60,
             "the fake LLM server", self.diagnose)

    @property
    def llm_url(self) -> str:
        return f"http://{self.head.address}:{LLM_PORT}"

    def node_env(self, node: Node, **extra: str) -> dict[str, str]:
        # a node's /run is its own: harness sessions' gateway sockets are not seen by the other nodes
        if self.shard_urls:  # the README's nodes are given the head's shards as its Redis
            extra.setdefault("PRORL_STORE_SHARDS", ",".join(self.shard_urls))
        return base_env(PRORL_REDIS_URL=self.redis_url, PRORL_API_TOKEN=self.token,
                        PRORL_SANDBOX_ROOT=str(node.scratch / "sandboxes"),
                        PRORL_GATEWAY_SOCKET_DIR=str(self.gateway_dir(node)), **extra)

    def gateway_dir(self, node: Node) -> Path:
        """The node's own gateway socket directory (where its /run/prorl-gateway would be); under
        /run, not the test's tmp: a sandbox's /tmp is its own."""
        return Path("/run") / f"prorl-multinode-{os.getpid()}-{node.name}"

    def start_readme_node(self, node: Node) -> None:
        """The README's cluster commands, one process each."""
        env = self.node_env(node)
        py = [sys.executable, "-m"]
        node.spawn("sandbox-host", [*py, "prorl_celery.ops.cli", "sandbox-host", "--host", "0.0.0.0",
                                    "--capacity", str(CAPACITY)], env, self.logs)
        for queue, threads in QUEUE_THREADS.items():
            node.spawn(f"worker-{queue}", [*py, "celery", "-A", "prorl_celery", "worker", "-Q", queue,
                                           "-n", f"{queue}@%h", "-c", str(threads), "--loglevel",
                                           "INFO", "--without-mingle", "--without-gossip"],
                       env, self.logs)

    def start_slurm_node(self, node: Node) -> None:
        """``worker_node.sh`` run by hand, as its header says it may be."""
        env = self.node_env(node, PRORL_PYTHON=sys.executable, PRORL_SLURM_DIR=str(SLURM),
                            PRORL_STATE_DIR=str(self.work / f"{node.name}-state"),
                            PRORL_LOG_DIR=str(self.logs),
                            PRORL_SANDBOX_CAPACITY=str(CAPACITY), PRORL_RUN_WORKER_PROCESSES="2",
                            **{f"PRORL_{q.upper()}_CONCURRENCY": str(n) for q, n in QUEUE_THREADS.items()})
        node.spawn("worker-node-sh", ["bash", str(SLURM / "worker_node.sh"), str(self.head_file)],
                   env, self.logs, cwd=self.work)

    def hosts(self) -> dict[str, dict]:
        """Live sandbox hosts as /healthz lists them: host id -> record."""
        body = self.http("GET", "/healthz").json()
        return {h["host_id"]: h for h in body["sandbox_hosts"]}

    def wait_ready(self, hosts: int = 2, timeout: float = 240) -> dict:
        """Until /healthz shows ``hosts`` sandbox hosts and a worker per node on each queue."""
        def ready() -> dict | None:
            body = self.http("GET", "/healthz").json()
            enough = all(body["workers"].get(q, 0) >= hosts for q in ("init", "run", "eval"))
            return body if enough and len(body["sandbox_hosts"]) >= hosts else None
        return poll(ready, timeout, f"{hosts} sandbox hosts and workers", self.diagnose, pause=1)

    def reap_cgroups(self, node: Node) -> int:
        """The cgroups of sandboxes whose host died with ``node`` (what a host restarted on that
        node would sweep at its start)."""
        from sandboxes.runtimes.limits import cgroups

        roots = node.scratch / "sandboxes"
        return sum(cgroups.sweep(cgroups.host_key(str(path)))
                   for path in (roots.iterdir() if roots.is_dir() else []) if path.is_dir())

    def stop(self) -> None:
        for node in (self.node1, self.node2, self.head):
            if node in self.fabric.nodes:
                node.stop()
                self.reap_cgroups(node)
            shutil.rmtree(self.gateway_dir(node), ignore_errors=True)


@contextlib.contextmanager
def running(work: Path, **head_env: str) -> Iterator[Cluster]:
    """The three nodes on a fabric of their own, the head started with ``head_env`` added, node1 as
    the README's commands and node2 as worker_node.sh, ready; everything removed on the way out."""
    with netns.fabric() as fabric:
        built = Cluster(fabric, work)
        try:
            built.start_head(**head_env)
            built.start_readme_node(built.node1)
            built.start_slurm_node(built.node2)
            built.wait_ready()
            yield built
        finally:
            built.stop()
