"""Real processes only: a private redis-server and sandbox hosts started as subprocesses."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

REPO = Path(__file__).resolve().parents[2]
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture(scope="session")
def sandbox_redis() -> Iterator[str]:
    """URL of a private redis-server on a free port, killed at the end of the session."""
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("redis-server not installed")
    port = free_port()
    proc = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)

    def up() -> bool:
        try:
            return client.ping()
        except redis.ConnectionError:
            return False

    assert wait_until(up, 10), "redis-server did not start"
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture
def redis_client(sandbox_redis: str) -> redis.Redis:
    client = redis.Redis.from_url(sandbox_redis)
    client.flushdb()
    return client


@pytest.fixture
def sandbox_root() -> Iterator[Path]:
    """A workspace root the sandboxes' own uids can reach (pytest's tmp_path is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="prorl-test-sandboxes-"))
    root.chmod(0o711)
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


def needs_bwrap():
    from sandboxes.runtimes.bwrap import bwrap_works

    return pytest.mark.skipif(not bwrap_works(), reason="bubblewrap missing or namespaces forbidden "
                              "here (scripts/install-system-deps.sh installs it)")


@dataclass
class HostProc:
    proc: subprocess.Popen
    address: str
    token: str
    host_id: str

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=10)


@pytest.fixture
def start_host(sandbox_redis: str, tmp_path: Path, sandbox_root: Path):
    """Factory: ``start_host(capacity=2, lease_s=..., register=True, runtime=None, warm=0,
    env=None, runtimes=None, runtime_config=None)`` -> a running host process; workspaces go
    under ``sandbox_root``. The host allows ``local`` (the test operator does) unless ``env``
    says otherwise (a value of None removes a variable)."""
    started: list[HostProc] = []

    def start(capacity: int = 4, lease_s: float | None = None, register: bool = True,
              heartbeat_s: float = 0.5, runtime: str | None = None, warm: int = 0,
              host_id: str | None = None, env: dict[str, str | None] | None = None,
              runtimes: str | None = None, runtime_config: dict | None = None) -> HostProc:
        token = f"token-{len(started)}"
        host_id = host_id or f"test-host-{len(started)}"
        ready = tmp_path / f"ready-{len(started)}.json"
        roots = {name: {"root": str(sandbox_root)} for name in ("local", "bwrap")}
        for name, extra in (runtime_config or {}).items():
            roots.setdefault(name, {}).update(extra)
        argv = [sys.executable, "-m", "sandboxes.host.main", "--token", token, "--host-id", host_id,
                "--capacity", str(capacity), "--redis-url", sandbox_redis,
                "--ready-file", str(ready), "--log-level", "WARNING", "--warm", str(warm),
                "--runtime-config", json.dumps(roots)]
        if lease_s:
            argv += ["--lease-s", str(lease_s)]
        if not register:
            argv.append("--no-register")
        if runtimes:
            argv += ["--runtimes", runtimes]
        env = {**os.environ, "PYTHONPATH": str(REPO), "PRORL_HOST_HEARTBEAT_S": str(heartbeat_s),
               "PRORL_ALLOW_LOCAL_RUNTIME": "1", **(env or {})}
        env = {name: value for name, value in env.items() if value is not None}
        if runtime:
            env["PRORL_SANDBOX_RUNTIME"] = runtime
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline().strip()
        assert line.startswith("sandbox-host ready http://"), line
        address = line.split()[-1]
        assert json.loads(ready.read_text())["address"] == address
        host = HostProc(proc, address, token, host_id)
        started.append(host)
        return host

    yield start
    for host in started:
        try:
            host.stop()  # SIGTERM: the host removes its sandboxes' workspaces
        except subprocess.TimeoutExpired:
            host.proc.kill()
            host.proc.wait()
