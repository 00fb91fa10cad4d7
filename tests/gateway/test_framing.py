"""The gateway's request reader alone (no socket): requests come out whole whatever the bytes'
split, the credential is decided from the head before any body is taken, and every cap holds on
the running total (a chunk's announced size is never trusted, nor allocated)."""
from __future__ import annotations

import random
import tracemalloc

import pytest

from prorl_celery.gateway.framing import Refusal, RequestReader

pytestmark = pytest.mark.unit


def _reader(**caps):
    taken: list[int] = []
    reader = RequestReader(lambda m, p, h: None if h.get("authorization") == "Bearer k" else
                           Refusal(401, "auth", "no"), reserve=lambda n: taken.append(n) or True, **caps)
    return reader, taken


def _requests(rng: random.Random) -> tuple[bytes, list[tuple[str, str, bytes]]]:
    wire, expected = b"", []
    for _ in range(rng.randint(1, 6)):
        body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 3000)))
        kind = rng.choice(["get", "length", "chunked"])
        if kind == "get":
            wire += b"GET /v1/models?x=1 HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer k\r\n\r\n"
            expected.append(("GET", "/v1/models", b""))
            continue
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer k\r\n"
        if kind == "length":
            wire += head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        else:
            wire += head + b"Transfer-Encoding: chunked\r\n\r\n"
            rest = body
            while rest:
                n = rng.randint(1, len(rest))
                wire += b"%x;ext=1\r\n" % n + rest[:n] + b"\r\n"
                rest = rest[n:]
            wire += b"0\r\n\r\n"
        expected.append(("POST", "/v1/chat/completions", body))
    return wire, expected


def test_requests_come_out_whole_however_the_bytes_are_split():
    rng = random.Random(32)
    for _ in range(200):
        wire, expected = _requests(rng)
        reader, _ = _reader()
        k = 0
        while k < len(wire):
            n = rng.choice([1, 2, 7, 100, 4096, len(wire)])
            reader.feed(wire[k:k + n])
            k += n
        got = [(r.method, r.path, r.body) for r in reader.ready]
        assert got == expected
        assert not reader.started


def test_the_credential_is_decided_from_the_head_before_any_body():
    reader, taken = _reader()
    with pytest.raises(Refusal) as refused:
        reader.feed(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 1000\r\n\r\n" + b"x" * 1000)
    assert refused.value.status == 401 and taken == []  # not a byte of body taken


def test_a_huge_chunk_is_refused_past_the_cap_without_being_allocated():
    cap = 1 << 20
    reader, taken = _reader(max_body=cap)
    reader.feed(b"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer k\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % (256 << 20))
    piece, fed = b"x" * 65536, 0
    tracemalloc.start()
    try:
        with pytest.raises(Refusal) as refused:
            while fed < (256 << 20):
                reader.feed(piece)
                fed += len(piece)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused.value.status == 413 and fed <= cap
    assert peak < 4 * cap, peak  # what arrived, never the 256 MB the chunk announced


@pytest.mark.parametrize("wire,status", [
    (b"POST / HTTP/1.1\r\nAuthorization: Bearer k\r\nContent-Length: 99999999999\r\n\r\n", 413),
    (b"POST / HTTP/1.1\r\nAuthorization: Bearer k\r\nContent-Length: -1\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nAuthorization: Bearer k\r\nContent-Length: 1x\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nAuthorization: Bearer k\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nAuthorization: Bearer k\r\nContent-Length: 3\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nAuthorization: Bearer k\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", 431),
    (b"GET / HTTP/1.1\r\nX-Long: " + b"a" * 70000, 431),
])
def test_malformed_and_oversized_heads_are_refused(wire, status):
    reader, _ = _reader()
    with pytest.raises(Refusal) as refused:
        for k in range(0, len(wire), 4096):
            reader.feed(wire[k:k + 4096])
    assert refused.value.status == status, refused.value.message
