"""What every benchmark that starts its own stack needs before the project is imported: a private
Redis address with a password, fixed in the environment so that this process and every child
point at it, and the operator settings of a benchmark run (the ``local`` runtime allowed)."""
from __future__ import annotations

import os
import secrets
import socket


def _free_port() -> int:
    # not prorl_celery.ops.procs.free_port: importing the package configures the Celery app from the
    # environment, which must hold the URL below first
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


REDIS_PORT = _free_port()
REDIS_PASSWORD = secrets.token_urlsafe(24)
os.environ["PRORL_REDIS_URL"] = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{REDIS_PORT}/0"
os.environ["PRORL_ALLOW_LOCAL_RUNTIME"] = "1"  # the benchmarks measure the service, not isolation
