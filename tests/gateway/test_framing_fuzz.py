"""A seeded fuzz of a live gateway's framing over real sockets (a few seconds): valid requests
pipelined, split and sent slowly; and the same mutated (lengths, chunk sizes, flipped and
inserted bytes, truncations). Whatever comes, every answer is a whole HTTP response of an
expected status (never a 500), the valid ones are answered in order, the session's bytes in
flight and connections go back to none, no more call threads than the cap, nothing fails in the
loop, and an honest call is answered after; a head that stalls is cut at its deadline."""
from __future__ import annotations

import logging
import random
import secrets
import socket
import threading
import time
from types import SimpleNamespace

from prorl_celery.gateway import Gateway, GatewaySession
from prorl_celery.gateway.serving import Limits
from tests.conftest import wait_until

SEED, BUDGET_S, MIN_CASES = 3200, 3.0, 25
ALLOWED = {200, 400, 401, 404, 413, 431, 503}
TOKEN = "fuzz-" + secrets.token_hex(8)


def _gateway(limits: Limits | None = None) -> Gateway:
    never = lambda req, stop: (_ for _ in ()).throw(AssertionError("no generation here"))  # noqa: E731
    log = SimpleNamespace(wake=lambda: None, transcript=SimpleNamespace(size=0))  # nothing generated, nothing recorded
    return Gateway(GatewaySession(f"fuzz-{secrets.token_hex(4)}", never, log=log), token=TOKEN,
                   limits=limits).start()


def _valid(rng: random.Random) -> tuple[bytes, int]:
    """One request and the status it gets: the models (200) or a chat call whose body is not
    JSON (400: read whole, refused before the session)."""
    auth = b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
    if rng.random() < 0.3:
        return b"GET /v1/models HTTP/1.1\r\nHost: f\r\n" + auth + b"\r\n", 200
    body = b"not json " + bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 2000)))
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: f\r\n" + auth
    if rng.random() < 0.5:
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body, 400
    wire, rest = head + b"Transfer-Encoding: chunked\r\n\r\n", body
    while rest:
        n = rng.randint(1, len(rest))
        wire, rest = wire + b"%x\r\n" % n + rest[:n] + b"\r\n", rest[n:]
    return wire + b"0\r\n\r\n", 400


def _mutate(rng: random.Random, wire: bytes) -> bytes:
    k = rng.randrange(len(wire))
    choice = rng.randrange(6)
    if choice == 0:
        return wire[:k] + bytes([rng.getrandbits(8)]) + wire[k + 1:]
    if choice == 1:
        return wire[:k] + bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40))) + wire[k:]
    if choice == 2:
        return wire[:k]
    size = rng.choice([b"-1", b"99999999999999999999", b"0x10", b"", b"1 2", b"%d" % rng.randint(0, 1 << 40)])
    if choice == 3 and b"Content-Length: " in wire:
        head, _, rest = wire.partition(b"Content-Length: ")
        return head + b"Content-Length: " + size + b"\r\n" + rest.partition(b"\r\n")[2]
    if choice == 4 and b"chunked\r\n\r\n" in wire:
        head, _, rest = wire.partition(b"chunked\r\n\r\n")
        return head + b"chunked\r\n\r\n" + rng.choice([b"fffffffffffffff", b"-1", b"zz", b"10000000"]) + b"\r\n" + rest
    return wire.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n", 1)


def _answers(sock: socket.socket, quiet_s: float) -> list[int]:
    """Statuses of the whole responses read until the peer closes or is quiet ``quiet_s``;
    asserts each one is whole and well formed."""
    sock.settimeout(quiet_s)
    data, statuses = b"", []
    while True:
        try:
            chunk = sock.recv(65536)
        except (socket.timeout, ConnectionResetError):
            chunk = b""
        data += chunk
        while b"\r\n\r\n" in data:
            head, _, rest = data.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            assert lines[0].startswith(b"HTTP/1.1 "), lines[0]
            fields = dict(line.lower().split(b": ", 1) for line in lines[1:])
            length = int(fields[b"content-length"])
            if len(rest) < length:
                break
            statuses.append(int(lines[0].split()[1]))
            data = rest[length:]
        if not chunk:
            assert data == b"", data[:200]  # nothing half sent
            return statuses


def _case(rng: random.Random, address) -> None:
    requests = [_valid(rng) for _ in range(rng.randint(1, 4))]
    wire = b"".join(w for w, _ in requests)
    mutated = rng.random() < 0.6
    if mutated:
        wire = _mutate(rng, wire)
    with socket.create_connection(address, timeout=5) as sock:
        slow = rng.randint(1, 3) if rng.random() < 0.3 else 0  # a slow head: its first bytes a few at a time
        try:
            for k in range(0, min(len(wire), 120) if slow else 0, slow or 1):
                sock.sendall(wire[k:k + slow])
                time.sleep(0.001)
            sock.sendall(wire[min(len(wire), 120) if slow else 0:])
            sock.shutdown(socket.SHUT_WR)  # all sent: the gateway answers what it can, then closes
        except (BrokenPipeError, ConnectionResetError):  # refused, and closed: what it answered is read below
            assert mutated
        statuses = _answers(sock, 5)
    assert set(statuses) <= ALLOWED, statuses
    if not mutated:
        assert statuses == [s for _, s in requests]


def test_the_framing_holds_under_a_fuzz(caplog):
    caplog.set_level(logging.ERROR)
    gateway = _gateway()
    rng = random.Random(SEED)
    try:
        address = gateway.address[:2]
        deadline, cases = time.monotonic() + BUDGET_S, 0
        while cases < MIN_CASES or time.monotonic() < deadline:  # a loaded machine runs the minimum
            _case(rng, address)
            cases += 1
        calls = [t for t in threading.enumerate() if t.name.startswith(f"gateway-{gateway.session.session_id}")]
        assert len(calls) <= gateway.serving.limits.call_threads
        wait_until(lambda: not gateway.serving.conns, 10, "the fuzz's connections to be closed")
        assert gateway.serving._inflight == 0
        with socket.create_connection(address, timeout=5) as sock:
            sock.sendall(_valid(random.Random(1))[0])
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: f\r\nAuthorization: Bearer " + TOKEN.encode()
                         + b"\r\nConnection: close\r\n\r\n")
            assert _answers(sock, 5)[-1] == 200
    finally:
        gateway.close()
    failed = [r for r in caplog.records if r.name.startswith(("prorl_celery.netloop", "prorl_celery.gateway"))]
    assert not failed, [r.getMessage() for r in failed]


def test_a_stalled_head_or_body_is_cut_at_its_deadline():
    gateway = _gateway(Limits(head_s=0.5, body_s=0.5))
    try:
        address = gateway.address[:2]
        stalled = [b"POST /v1/chat/completions HTTP/1.1\r\nHost: f\r\n",
                   b"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode()
                   + b"\r\nContent-Length: 100\r\n\r\nabc"]
        for wire in stalled:
            with socket.create_connection(address, timeout=10) as sock:
                sock.sendall(wire)
                sock.settimeout(10)
                assert sock.recv(65536) == b""  # closed by the gateway, not by this timeout
        wait_until(lambda: not gateway.serving.conns, 10, "the stalled connections to be gone")
        assert gateway.serving._inflight == 0
    finally:
        gateway.close()
