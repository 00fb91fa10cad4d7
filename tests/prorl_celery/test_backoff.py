"""The one backoff (prorl_celery/backoff.py): its schedule, its jitter, a wait that a stop cuts
short, and the trainer's client retrying a real server's 503 on that schedule."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from prorl_celery import client as client_module
from prorl_celery.backoff import Backoff, wait
from prorl_celery.client import ProrlClient
from prorl_celery.errors import StoreUnavailable


@pytest.mark.unit
def test_pauses_double_up_to_the_cap():
    backoff = Backoff(0.2, 1.0)
    assert [backoff.pause(n) for n in range(1, 6)] == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0])
    assert backoff.base(10_000) == 1.0  # no overflow far out
    with pytest.raises(ValueError):
        backoff.pause(0)
    with pytest.raises(ValueError):
        Backoff(1.0, 2.0, jitter=(1.0, 0.5))


@pytest.mark.unit
def test_jitter_stays_within_its_bounds_and_varies():
    backoff = Backoff(1.0, 8.0, jitter=(0.5, 1.0))
    pauses = [backoff.pause(3) for _ in range(200)]
    assert all(2.0 <= p <= 4.0 for p in pauses)
    assert len(set(pauses)) > 100  # drawn, not fixed: callers that failed together spread out


@pytest.mark.unit
def test_wait_returns_early_once_stopped():
    stop_at = time.monotonic() + 0.2
    started = time.monotonic()
    assert wait(30.0, lambda: time.monotonic() >= stop_at, poll_s=0.02) is False
    assert time.monotonic() - started < 10.0
    assert wait(0.05, lambda: False, poll_s=0.01) is True
    assert wait(0.0) is True


class _Busy(BaseHTTPRequestHandler):
    """Answers every request 503 with the service's error body, counting them."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.calls += 1  # type: ignore[attr-defined]
        data = b'{"error": {"type": "store_unavailable", "message": "the job store is unavailable; retry"}}'
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def busy() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    server.calls = 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_client_retries_a_503_on_the_backoff_schedule(busy, monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr(client_module, "wait", lambda seconds: pauses.append(seconds) or True)
    client = ProrlClient(f"http://127.0.0.1:{busy.server_address[1]}", token="t", retries=4, timeout=10)
    with pytest.raises(StoreUnavailable) as caught:
        client.get("some-job")
    assert busy.calls == 5 and caught.value.status == 503
    assert pauses == pytest.approx([0.2, 0.4, 0.8, 1.6])
