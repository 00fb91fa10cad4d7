"""Row 15: 300 idle ``GET /events`` connections made ``/healthz`` time out. Now streams and long
polls are capped per client and in total (429 past either), and run on threads of their own, so
/healthz and submissions answer while the streams are held."""
from __future__ import annotations

import json
import socket
import time

import pytest
import requests

from prorl_celery.ops.procs import wait_for
from tests.conftest import start_api

TOTAL, PER_CLIENT = 300, 200


def open_stream(port: int, token: str, source: str = "127.0.0.1",
                path: str = "/events?cursor=latest") -> tuple[socket.socket, int, bytes]:
    """A raw HTTP request left open; returns the socket, the status and what came first. Streams
    start at the newest completion, so that they are idle whatever the suite ran before (from the
    start, each would replay the whole history: thousands of jobs after the API fuzz test)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    return sock, status, head


def timed(method: str, url: str, **kwargs) -> tuple[float, requests.Response]:
    start = time.monotonic()
    resp = requests.request(method, url, timeout=10, **kwargs)
    return time.monotonic() - start, resp


@pytest.fixture(scope="module")
def capped_api(stack, tmp_path_factory):
    """An API of its own with known caps and only 4 ordinary threads: if streams took those,
    nothing else would be served."""
    child, url = start_api(stack, tmp_path_factory.mktemp("capped"), "api-capped", PRORL_API_MAX_STREAMS=str(TOTAL),
                           PRORL_API_MAX_STREAMS_PER_CLIENT=str(PER_CLIENT), PRORL_API_THREADS="4")
    port = int(url.rsplit(":", 1)[1])
    yield port, url, stack.api_token
    child.stop()


def test_300_idle_streams_do_not_starve_healthz_or_submissions(capped_api):
    port, url, token = capped_api
    auth = {"Authorization": f"Bearer {token}"}
    held = []
    try:
        for i in range(TOTAL):
            source = "127.0.0.1" if i < PER_CLIENT else "127.0.0.2"
            sock, status, head = open_stream(port, token, source)
            held.append(sock)
            assert status == 200 and b"text/event-stream" in head, (i, head)
        # one more from a client at its cap, one more from a fresh client past the total
        for source, reason in (("127.0.0.1", b"this client"), ("127.0.0.3", b"the API already serves")):
            sock, status, head = open_stream(port, token, source)
            body = head.split(b"\r\n\r\n", 1)[1] or sock.recv(4096)
            sock.close()
            assert status == 429, head
            error = json.loads(body)["error"]
            assert error["type"] == "too_many_requests" and reason.decode() in error["message"], error
        # a long poll counts too
        _, status, head = open_stream(port, token, "127.0.0.3", "/completions?wait=30")
        assert status == 429, head
        for _ in range(3):
            elapsed, health = timed("GET", f"{url}/healthz")
            assert health.status_code == 200 and elapsed < 2.0, (elapsed, health.text[:200])
            elapsed, posted = timed("POST", f"{url}/jobs", headers=auth,
                                    json={"instance": {"data_source": "shell", "commands": ["true"]}})
            assert posted.status_code == 202 and elapsed < 2.0, (elapsed, posted.text[:200])
    finally:
        for sock in held:
            sock.close()
    # closed streams give their slots back (the server notices at a stream's next keepalive)
    wait_for(lambda: _one_stream(port, token), 40, "a stream slot once the idle ones closed", pause=1)


def _one_stream(port: int, token: str) -> bool:
    sock, status, _ = open_stream(port, token, "127.0.0.3")
    sock.close()
    return status == 200

