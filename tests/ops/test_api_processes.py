"""Several API servers on one port (``prorl-celery api --reuse-port``, ``up --api-processes K``):
each binds with SO_REUSEPORT and the kernel spreads new connections between them; without it a
second server on the port is refused. In process: two of the API's own servers, tiny apps."""
from __future__ import annotations

import threading
from collections import Counter

import pytest
import requests
from flask import Flask

from prorl_celery.ops.procs import free_port
from prorl_celery.ops.serve import make_server


def _app(name: str) -> Flask:
    app = Flask(name)
    app.add_url_rule("/who", "who", lambda: name)
    return app


def _serve(name: str, port: int, reuse_port: bool):
    server = make_server(_app(name), host="127.0.0.1", port=port, reuse_port=reuse_port, max_per_client=64,
                         header_timeout_s=5, threads=4)
    threading.Thread(target=server.run, daemon=True).start()
    return server


def test_two_servers_share_one_port_and_both_answer():
    port = free_port()
    servers = [_serve(name, port, True) for name in ("a", "b")]
    try:
        answered = Counter(requests.get(f"http://127.0.0.1:{port}/who", timeout=5).text for _ in range(64))
        assert set(answered) == {"a", "b"}, answered  # each fresh connection may go to either
    finally:
        for server in servers:
            server.close()


def test_without_reuse_port_a_second_server_is_refused():
    port = free_port()
    first = _serve("a", port, False)
    try:
        with pytest.raises(OSError):
            _serve("b", port, False)
    finally:
        first.close()
