"""The one HTTP client against a real HTTP/1.1 server on a socket: a connection is kept alive
and reused across calls, one the server closed while idle is replaced before reuse, and one the
server drops as the request arrives (an idle timeout racing the request) is sent again once,
only when the method is idempotent."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from prorl_celery import http


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        server: Server = self.server  # type: ignore[assignment]
        self.served = getattr(self, "served", 0) + 1
        with server.lock:
            server.seen.append((self.command, self.client_address[1], body))
        if server.mode == "drop-all" or (self.served > 1 and server.mode == "drop-second"):
            self.close_connection = True
            return
        data = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if server.mode == "close-after":  # closed while idle, without saying so
            self.close_connection = True

    do_GET = do_POST = _answer


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.seen: list[tuple[str, int, bytes]] = []
        self.mode = "keep"
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def ports(self) -> set[int]:
        return {port for _, port, _ in self.seen}


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _in_thread(fn):
    """Run ``fn`` on a fresh thread (a fresh connection pool) and return its result or raise."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_calls_from_one_thread_share_one_connection(server):
    def three() -> list:
        return [http.request_json(m, server.url + "/x", b, timeout=5)
                for m, b in (("GET", None), ("POST", {"a": 1}), ("GET", None))]

    assert _in_thread(three) == [(200, {"ok": True})] * 3
    assert len(server.seen) == 3 and len(server.ports()) == 1
    _in_thread(lambda: http.request_json("GET", server.url + "/y", timeout=5))
    assert len(server.ports()) == 2  # another thread, its own connection


def test_a_connection_closed_while_idle_is_replaced_before_reuse(server):
    server.mode = "close-after"

    def two_posts() -> list:
        first = http.request_json("POST", server.url + "/gen", {"n": 1}, timeout=5)
        time.sleep(0.3)  # idle: the server's close has arrived (the race with it is the next test's)
        return [first, http.request_json("POST", server.url + "/gen", {"n": 2}, timeout=5)]

    assert _in_thread(two_posts) == [(200, {"ok": True})] * 2
    assert [body for _, _, body in server.seen] == [b'{"n":1}', b'{"n":2}']  # each sent once
    assert len(server.ports()) == 2


def test_a_get_dropped_on_a_reused_connection_is_sent_again_once(server):
    server.mode = "drop-second"

    def two_gets() -> list:
        return [http.request_json("GET", server.url + "/models", timeout=5) for _ in range(2)]

    assert _in_thread(two_gets) == [(200, {"ok": True})] * 2
    assert len(server.seen) == 3 and len(server.ports()) == 2  # the second GET: dropped, then resent


def test_a_post_dropped_on_a_reused_connection_is_not_sent_again(server):
    server.mode = "drop-second"

    def two_posts() -> None:
        http.request_json("POST", server.url + "/gen", {"n": 1}, timeout=5)
        http.request_json("POST", server.url + "/gen", {"n": 2}, timeout=5)

    with pytest.raises(http.TransportError, match="RemoteDisconnected"):
        _in_thread(two_posts)
    assert [body for _, _, body in server.seen] == [b'{"n":1}', b'{"n":2}']  # the generate: once


def test_a_request_dropped_on_a_fresh_connection_is_not_retried(server):
    server.mode = "drop-all"
    with pytest.raises(http.TransportError):
        _in_thread(lambda: http.request_json("GET", server.url + "/a", timeout=5))
    assert len(server.seen) == 1  # only a reused connection can have gone stale


def test_a_post_does_not_reuse_a_connection_idle_past_the_servers_keepalive(server, monkeypatch):
    monkeypatch.setattr(http, "SAFE_IDLE_S", 0.2)

    def calls() -> None:
        http.request_json("POST", server.url + "/gen", {"n": 1}, timeout=5)
        http.request_json("POST", server.url + "/gen", {"n": 2}, timeout=5)  # at once: reused
        time.sleep(0.4)
        http.request_json("GET", server.url + "/models", timeout=5)  # resendable: reused
        time.sleep(0.4)
        http.request_json("POST", server.url + "/gen", {"n": 3}, timeout=5)  # idle 0.4 s: a new one

    _in_thread(calls)
    assert [port for _, port, _ in server.seen].count(server.seen[0][1]) == 3
    assert len(server.ports()) == 2


def test_headers_and_body_leave_in_one_segment():
    """The server's first read of each request holds the headers and the body: the client corks
    the socket while http.client writes them (two sends), rather than overriding its internals."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    firsts: list[bytes] = []

    def serve(n: int) -> None:
        for _ in range(n):
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(10)
                firsts.append(conn.recv(1 << 16))  # waiting before the request is written
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    body = b"b" * 4000
    thread = threading.Thread(target=serve, args=(10,), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/x"
    try:
        for _ in range(10):
            assert _in_thread(lambda: http.request("POST", url, data=body, timeout=10).content) == b"ok"
    finally:
        thread.join(30)
        listener.close()
    assert len(firsts) == 10 and all(first.endswith(b"\r\n\r\n" + body) for first in firsts)


def test_no_subclass_of_http_clients_connection():
    """No override of http.client's private methods (``_send_output`` ...): the module uses its
    connections as they are."""
    import http.client as std

    assert not [name for name, value in vars(http).items()
                if isinstance(value, type) and issubclass(value, std.HTTPConnection)]
