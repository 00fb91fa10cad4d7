"""The host's channel sends a response's head and its body in one write (sandboxes/host/gate.py,
``OneSendTask``), and what it sends is byte for byte what waitress's own task sends: real sockets,
real waitress, every kind of answer (a body within its length, past it, chunked, none, HEAD)."""
from __future__ import annotations

import socket
import threading

import pytest
import waitress

from sandboxes.host import loop as host_loop
from sandboxes.host.gate import gated_channel
from sandboxes.host.loop import EpollMap

ANSWERS = {  # path -> (status, headers, body chunks)
    "/small": ("200 OK", [("Content-Type", "application/json"), ("Content-Length", "11")], [b'{"ok":true}']),
    "/created": ("201 Created", [("Content-Length", "5")], [b"hello"]),
    "/excess": ("200 OK", [("Content-Length", "3")], [b"abcdef"]),  # waitress cuts it, and warns
    "/chunked": ("200 OK", [], [b"one", b"two"]),
    "/pieces": ("200 OK", [("Content-Length", "6")], [b"abc", b"def"]),
    "/empty": ("204 No Content", [], [b""]),
    "/big": ("200 OK", [("Content-Length", str(3 << 20))], [b"x" * (3 << 20)]),
}


def _app(environ, start_response):
    status, headers, chunks = ANSWERS[environ["PATH_INFO"]]
    start_response(status, list(headers))
    return list(chunks)


def _serve(channel_class):
    socket_map = EpollMap()
    server = waitress.create_server(_app, map=socket_map, host="127.0.0.1", port=0, threads=2,
                                    ident="test")
    writes: list[int] = []

    class Counted(channel_class):
        def write_soon(self, data):
            writes.append(len(data))
            return super().write_soon(data)

    server.channel_class = Counted
    thread = threading.Thread(target=host_loop.loop, args=(socket_map, 0.2), daemon=True)
    thread.start()
    return server, thread, writes


@pytest.fixture
def servers():
    gated = _serve(gated_channel(lambda method, path, headers: None))
    plain = _serve(waitress.channel.HTTPChannel)
    yield gated, plain
    for server, thread, _ in (gated, plain):
        server.close()
        thread.join(timeout=5)


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(1 << 16):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.startswith(b"Date: ")]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@pytest.mark.parametrize("method, path", [("GET", p) for p in ANSWERS] + [("HEAD", "/small")])
def test_the_same_bytes_as_waitress_head_and_body_in_one_write(servers, method, path):
    (gated, _, gated_writes), (plain, _, plain_writes) = servers
    request = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    ours = _raw(gated.effective_port, request)
    assert ours == _raw(plain.effective_port, request)
    if path in ("/small", "/created", "/big") and method == "GET":
        assert len(gated_writes) == 1 and len(plain_writes) == 2  # head + body: one write, not two
    else:
        assert sum(gated_writes) == sum(plain_writes)
