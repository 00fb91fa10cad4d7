"""Helpers of the memcap section of tests/security/test_hostile_harness.py."""
from __future__ import annotations

import socket
from urllib.parse import urlsplit


def answer_to_head(address: str, head: bytes, first: bytes = b"", timeout: float = 10) -> tuple[int, bytes]:
    """Send a request's head (and ``first``, the start of its body, nothing more) and read the
    answer: the host must answer without the rest of the body. Returns (status, body)."""
    url = urlsplit(address)
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as sock:
        sock.sendall(head + b"\r\n" + first)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < _length(data):
            chunk = sock.recv(65536)  # a host waiting for the body times out here
            if not chunk:
                break
            data += chunk
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ", 2)[1]), body


def _length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(data) + 1  # no length: read until the host closes
