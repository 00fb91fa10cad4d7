"""`prorl-celery up` as a user runs it: a private Redis, workers, beat, API, all authenticated with
secrets it generates into a 0600 file; SIGTERM leaves nothing."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import psutil
import requests

from prorl_celery.statedir import read_secrets


def _read_until(proc: subprocess.Popen, needle: str, timeout: float) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("up exited early:\n" + "".join(lines))
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} within {timeout}s:\n" + "".join(lines))


def test_up_then_sigterm_leaves_no_process(tmp_path):
    """(The demo itself runs in tests/docs/test_readme.py, as the README's first command.)"""
    # nothing of the test session's operator settings: up must work as a user runs it
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    proc = subprocess.Popen([sys.executable, "-m", "prorl_celery.ops.cli", "up", "--port", "0",
                             "--state-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = _read_until(proc, "ready", 90)
        api = next(line.split()[1] for line in lines if line.startswith("api "))
        redis_line = next(line for line in lines if line.startswith("redis "))
        assert "6379" not in redis_line  # a private Redis, not the machine's
        assert any(line.startswith("llm ") and "fake" in line for line in lines)  # the embedded fake LLM
        secrets_line = next(line for line in lines if line.startswith("secrets "))
        secrets_path = tmp_path / "secrets.env"
        assert str(secrets_path) in secrets_line
        assert stat.S_IMODE(secrets_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700
        saved = read_secrets(tmp_path)
        token, password = saved["PRORL_API_TOKEN"], saved["PRORL_REDIS_URL"].split(":")[2].split("@")[0]
        assert token not in "".join(lines) and password not in "".join(lines)  # said where, not what
        assert requests.get(f"{api}/jobs/x", timeout=10).status_code == 401  # loopback needs it too
        auth = {"Authorization": f"Bearer {token}"}
        assert requests.get(f"{api}/jobs/x", headers=auth, timeout=10).status_code == 404
        family = psutil.Process(proc.pid).children(recursive=True)
        assert len(family) >= 8  # redis, sandbox host, 4 workers, beat, api, fake LLM
        assert requests.get(f"{api}/healthz", timeout=10).json()["ok"] is True
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        time.sleep(0.5)
        alive = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], [p.cmdline() for p in alive]
        assert any(p.name.startswith("appendonly") for p in (tmp_path / "redis").iterdir())  # persisted
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_run_worker_splits_into_processes_that_all_serve(tmp_path, monkeypatch):
    """``run_worker_processes``: the run queue's threads split over that many worker processes
    (each holding its harness sessions' gateways), every one of them a consumer the health census
    counts, and a job still goes through."""
    from config.settings import get_settings
    from tests.conftest import own_stack, submit, wait

    monkeypatch.setattr(get_settings(), "run_worker_processes", 2)
    with own_stack(tmp_path, concurrency={"init": 1, "run": 3, "eval": 1}) as stack:
        run = {name: child for name, child in stack.children.items() if name.startswith("worker-run")}
        assert sorted(run) == ["worker-run", "worker-run-2"]
        assert sorted(child.argv[child.argv.index("-c") + 1] for child in run.values()) == ["1", "2"]
        health = requests.get(f"{stack.api_url}/healthz", timeout=10).json()
        assert health["workers"]["run"] == 2
        job = submit(stack.api_url, {"data_source": "shell", "commands": ["echo hi"]})
        assert wait(stack.api_url, job, timeout=120)["status"] == "completed"


def test_up_on_an_old_state_dir_drops_the_backends_that_no_longer_answer(tmp_path):
    """The private Redis keeps what an earlier run registered: on the next start, a backend whose
    server is gone is forgotten (it would be routed to and probed for ever), one that answers is
    kept. The stack's Redis alone, stopped and started again on the same state directory."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    import redis

    from prorl_celery.llm.registry import BackendRegistry
    from prorl_celery.ops.launcher import Stack, StackOptions
    from prorl_celery.ops.procs import free_port

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    live = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=live.serve_forever, daemon=True).start()
    live_url, dead_url = f"http://127.0.0.1:{live.server_address[1]}", f"http://127.0.0.1:{free_port()}"
    try:
        first = Stack(StackOptions(state_dir=tmp_path))
        first.start_redis()
        ids = {url: first.register_llm(url, protocol="generate", dialect="fake") for url in (live_url, dead_url)}
        first.stop()

        again = Stack(StackOptions(state_dir=tmp_path))
        again.start_redis()
        try:
            registry = BackendRegistry(redis.Redis.from_url(again.redis_url))
            assert sorted(registry.ids()) == sorted(ids.values())  # the earlier run's, persisted
            dropped = again.drop_dead_backends()
            assert [(bid, address) for bid, address, _ in dropped] == [(ids[dead_url], dead_url)]
            assert registry.ids() == [ids[live_url]]
            assert again.drop_dead_backends() == []
        finally:
            again.stop()
    finally:
        live.shutdown()
