"""Cheap connections against the API as ``prorl-celery api`` serves it (``prorl_celery/ops/serve.py``):
thousands of idle sockets from one client, a connection that never sends a head, one that drips
its head a byte at a time. None needs a token; none may keep ``/healthz`` from answering."""
from __future__ import annotations

import resource
import select
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import requests

from tests.conftest import API_TOKEN, start_api, wait_until

IDLE = 2000
PER_CLIENT = 300
HEAD_S = 3.0
ATTACKER = "127.0.0.2"  # one client (a loopback address of its own); the probes come from 127.0.0.1


@pytest.fixture(scope="module")
def guarded_api(stack, tmp_path_factory) -> Iterator[str]:
    child, url = start_api(stack, tmp_path_factory.mktemp("api-conn"), "api-connections",
                           PRORL_API_MAX_CONNECTIONS_PER_CLIENT=str(PER_CLIENT),
                           PRORL_API_HEADER_TIMEOUT_S=str(HEAD_S))
    try:
        yield url
    finally:
        child.stop()


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def _open_idle(address: tuple[str, int], n: int, source: str = ATTACKER) -> list[socket.socket]:
    """``n`` connections from ``source`` that never send a byte (non-blocking connects: none waits
    for the server to accept it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 512:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 1024), hard))
    socks = []
    for _ in range(n):
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((source, 0))
        sock.connect_ex(address)
        socks.append(sock)
    return socks


def _closed_by_server(socks: list[socket.socket]) -> list[socket.socket]:
    """The sockets of ``socks`` the server has closed (readable, and reading gives end of file)."""
    poller = select.poll()
    by_fd = {sock.fileno(): sock for sock in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    closed = []
    for fd, _ in poller.poll(0):
        try:
            if by_fd[fd].recv(1) == b"":
                closed.append(by_fd[fd])
        except (ConnectionResetError, BrokenPipeError):
            closed.append(by_fd[fd])
        except BlockingIOError:
            pass
    return closed


def test_healthz_answers_while_one_client_holds_2000_idle_connections(guarded_api):
    opened = time.monotonic()
    idle = _open_idle(_address(guarded_api), IDLE)
    try:
        # the client's connections past its cap are closed as they are accepted; the rest it holds
        closed = wait_until(lambda: (found := _closed_by_server(idle)) and len(found) >= IDLE - PER_CLIENT
                            and set(found), 60, "the cap to apply")
        held = [s for s in idle if s not in closed]
        assert len(held) <= PER_CLIENT
        if time.monotonic() - opened < HEAD_S:  # none can have met the head deadline yet
            assert len(held) == PER_CLIENT
        started = time.monotonic()
        resp = requests.get(f"{guarded_api}/healthz", timeout=10)  # the old server: 15 minutes
        assert resp.status_code == 200, f"{resp.status_code} after {time.monotonic() - started:.2f} s"
        # ... until the head deadline passes: a connection that sends nothing is not kept
        wait_until(lambda: len(_closed_by_server(held)) == len(held), 30 + HEAD_S, "the head deadline")
    finally:
        for sock in idle:
            sock.close()


def test_a_prober_on_the_attackers_own_host_is_answered(guarded_api):
    """The cap counts an address, and a harness runs on the trainer's host: holding all of it in
    idle sockets, re-opened as the server closes them, it must not keep that host's own prober
    from ``/healthz``. The prober's connection takes the place of the idlest one (before: it was
    closed at accept, every time, for as long as the attacker kept the cap full)."""
    address, source = _address(guarded_api), "127.0.0.1"  # the prober's own address
    idle = _open_idle(address, PER_CLIENT + 20, source)
    stop = threading.Event()

    def keep_full() -> None:  # what the head deadline or the cap closes is opened again
        while not stop.is_set():
            closed = _closed_by_server(idle)
            for sock in closed:
                idle.remove(sock)
                sock.close()
            idle.extend(_open_idle(address, len(closed), source))
            time.sleep(0.05)

    refill = threading.Thread(target=keep_full, daemon=True)
    try:
        wait_until(lambda: len(_closed_by_server(idle)) >= 20, 30, "the cap to apply")
        refill.start()
        answered = []
        for _ in range(5):  # spread over more than a head deadline: the attacker refills meanwhile
            try:
                answered.append(requests.get(f"{guarded_api}/healthz", timeout=10).status_code)
            except requests.ConnectionError as exc:
                answered.append(type(exc).__name__)
            time.sleep(HEAD_S / 4)
        assert answered == [200] * 5
    finally:
        stop.set()
        refill.join(5)
        for sock in idle:
            sock.close()


def _served(sock: socket.socket) -> bytes:
    """One whole request on a kept-alive connection, and its answer."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: api\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head


@pytest.mark.slow
@pytest.mark.parametrize("after_a_request", [False, True])
def test_a_head_dripped_byte_by_byte_is_cut_at_the_deadline(guarded_api, after_a_request):
    with socket.create_connection(_address(guarded_api), timeout=5) as sock:
        if after_a_request:  # the deadline runs from the next head's first byte
            assert _served(sock).startswith(b"HTTP/1.1 ")
            time.sleep(HEAD_S + 1)  # an idle kept-alive connection is not cut by it ...
            assert not _closed_by_server([sock])
            assert _served(sock).startswith(b"HTTP/1.1 ")  # ... and serves the next request
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        started = time.monotonic()
        closed = False
        while not closed and time.monotonic() - started < 30 + HEAD_S:
            try:
                sock.sendall(b"X")  # activity, which the idle timeout alone would accept
            except OSError:
                closed = True
            time.sleep(0.25)
            closed = closed or bool(_closed_by_server([sock]))
        assert closed and time.monotonic() - started >= HEAD_S


@pytest.mark.slow
def test_a_long_poll_outlives_the_head_deadline(guarded_api):
    auth = {"Authorization": f"Bearer {API_TOKEN}"}
    instance = {"data_source": "shell", "commands": [f"sleep {HEAD_S + 2}"], "sandbox": {"runtime": "local"}}
    (job_id,) = requests.post(f"{guarded_api}/jobs", json={"instance": instance}, headers=auth,
                              timeout=30).json()["job_ids"]
    resp = requests.get(f"{guarded_api}/jobs/{job_id}/wait", params={"timeout": 60}, headers=auth, timeout=70)
    assert resp.status_code == 200 and resp.json()["status"] == "completed"
    assert resp.json()["timings"]["run"] >= HEAD_S  # the request was served past the deadline
