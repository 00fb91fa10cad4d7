"""The sandbox host's event loop (sandboxes/host/loop.py): what waitress's loop served, it serves,
and a turn asks only the connections that moved, not every idle one: real sockets, real waitress."""
from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import waitress

from sandboxes.host import loop as host_loop
from sandboxes.host.loop import EpollMap
from tests.sandboxes.conftest import wait_until

BIG = 8 << 20  # more than the socket buffers hold: the answer goes out over many turns


def _app(environ, start_response):
    path = environ["PATH_INFO"]
    if path == "/slow":
        time.sleep(0.3)
    body = b"x" * BIG if path == "/big" else path.encode()
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


@pytest.fixture
def server() -> Iterator:
    socket_map = EpollMap()
    server = waitress.create_server(_app, map=socket_map, host="127.0.0.1", port=0, threads=64,
                                    channel_timeout=1, cleanup_interval=0.2)
    thread = threading.Thread(target=host_loop.loop, args=(socket_map, 0.2), daemon=True)
    thread.start()
    yield server
    server.close()
    thread.join(timeout=5)


def _get(conn: http.client.HTTPConnection, path: str) -> bytes:
    conn.request("GET", path)
    answer = conn.getresponse()
    assert answer.status == 200
    return answer.read()


def test_it_serves_what_waitress_served(server):
    port = server.effective_port
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(40)]
    for round_ in range(3):  # kept alive: the same connections again
        for k, conn in enumerate(conns):
            assert _get(conn, f"/{round_}/{k}") == f"/{round_}/{k}".encode()

    slow = [None] * 20  # served at once by the pool, each answered on its own connection
    def call(k: int) -> None:
        slow[k] = _get(conns[k], "/slow")
    threads = [threading.Thread(target=call, args=(k,)) for k in range(20)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert slow == [b"/slow"] * 20 and time.monotonic() - started < 3

    big = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    big.request("GET", "/big")
    answer = big.getresponse()
    time.sleep(0.3)  # the server's send buffer fills: the rest waits for the socket to drain
    assert len(answer.read()) == BIG
    assert _get(big, "/after") == b"/after"

    with socket.create_connection(("127.0.0.1", port)) as raw:  # two requests in one write
        raw.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while got.count(b"200 OK") < 2 or not got.endswith(b"/b"):
            got += raw.recv(65536)
        assert got.index(b"/a") < got.index(b"/b")

    gone = socket.create_connection(("127.0.0.1", port))  # a client that hangs up mid-request
    gone.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    gone.close()
    assert _get(conns[0], "/still") == b"/still"


def test_idle_connections_are_closed_after_the_channel_timeout(server):
    raw = socket.create_connection(("127.0.0.1", server.effective_port))
    raw.sendall(b"GET /once HTTP/1.1\r\nHost: x\r\n\r\n")
    raw.settimeout(10)
    got = b""
    while not got.endswith(b"/once"):
        got += raw.recv(65536)
    assert wait_until(lambda: raw.recv(1) == b"", timeout=5)  # closed by the server's maintenance
    raw.close()
    assert wait_until(lambda: len(server._map) == 2, timeout=5)  # the listener and the trigger


class _Counted:
    """Counts the loop's questions (``readable()``) to connections other than ``_Counted.busy``'s
    (the client's port)."""

    busy: int | None = None
    asked = 0

    def readable(self):
        if self.addr[1] != _Counted.busy:
            _Counted.asked += 1
        return super().readable()


def test_a_turn_asks_only_the_connections_that_moved(monkeypatch):
    """200 idle kept-alive connections, then 50 requests on another: waitress's loop asked all 200
    on each of the requests' turns (>= 2 a request: >= 20,000 questions); this one asks none of
    them (but once a second, patched away here)."""
    from sandboxes.host.main import SandboxHost
    from sandboxes.runtimes.bwrap import bwrap_works

    if not bwrap_works():
        pytest.skip("bubblewrap missing or namespaces forbidden here")
    monkeypatch.setattr(host_loop, "FULL_SCAN_S", 3600.0)  # no once-a-second look at all of them
    host = SandboxHost(register=False, runtimes=["bwrap"], capacity=64, warm=0)  # 256 connections
    host.server.channel_class = type("Counted", (_Counted, host.server.channel_class), {})
    thread = threading.Thread(target=host.run, daemon=True)
    thread.start()
    try:
        idle = [http.client.HTTPConnection("127.0.0.1", host.port, timeout=10) for _ in range(200)]
        for conn in idle:
            _get(conn, "/health")
        busy = http.client.HTTPConnection("127.0.0.1", host.port, timeout=10)
        _get(busy, "/health")
        time.sleep(0.2)  # the idle ones' last turns are over
        _Counted.busy, _Counted.asked = busy.sock.getsockname()[1], 0
        for _ in range(50):
            _get(busy, "/health")
        assert _Counted.asked == 0, f"idle connections asked {_Counted.asked} times during 50 requests"
    finally:
        host.shutdown()


def test_a_task_sending_its_answer_does_not_spin_the_loop(monkeypatch):
    """While a task thread sends its answer (its send slowed here to 0.2 s: bytes pending, the
    buffer's lock held) the connection looks writable: waitress's loop, and this one before,
    woke on every ready POLLOUT and found nothing it could send, hundreds of turns; now the
    connection is muted after one such turn, and the answer still arrives whole."""
    import select

    from waitress import wasyncore

    socket_map = EpollMap()
    server = waitress.create_server(_app, map=socket_map, host="127.0.0.1", port=0, threads=4)

    class SlowSend(server.channel_class):
        def _flush_some(self, do_close=True):
            if self.requests and self.requests[0].path.startswith("/slow-send"):  # the task's own send
                time.sleep(0.2)
            return super()._flush_some(do_close)

    server.channel_class = SlowSend
    turns: list[int] = []
    readwrite = wasyncore.readwrite

    def counted(obj, flags):
        if flags & select.POLLOUT:
            turns.append(flags)
        return readwrite(obj, flags)

    monkeypatch.setattr(host_loop.wasyncore, "readwrite", counted)
    thread = threading.Thread(target=host_loop.loop, args=(socket_map, 0.2), daemon=True)
    thread.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.effective_port, timeout=10)
        for k in range(3):
            assert _get(conn, f"/slow-send/{k}") == f"/slow-send/{k}".encode()
        assert len(turns) <= 6, f"{len(turns)} POLLOUT turns for 3 answers"
        assert _get(conn, "/big") == b"x" * BIG  # a socket that fills: the loop still sends for it
        conn.close()
    finally:
        server.close()
        thread.join(timeout=5)
