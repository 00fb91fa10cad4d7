"""Checkpoint swaps: drain backends (optionally aborting what they run) and resume them with a
new weight version."""
from __future__ import annotations

import time
from collections.abc import Callable

from prorl_celery.llm.models import BackendStatus
from prorl_celery.llm.registry import BackendRegistry

POLL_S = 0.05


def drain(registry: BackendRegistry, ids: list[str] | None, wait_s: float, abort: bool = False,
          sleep: Callable[[float], None] = time.sleep) -> dict:
    """Stop new requests to ``ids`` (all backends when None); with ``abort``, withdraw the leases
    of their in-flight requests, which then retry once some backend is active. Returns once
    nothing is in flight on them or ``wait_s`` ran out: ``{"drained", "in_flight", "aborted"}``."""
    ids = registry.resolve(ids)
    sources = [BackendStatus.ACTIVE, BackendStatus.QUARANTINED, BackendStatus.DRAINING]
    for bid in ids:
        registry.set_status(bid, BackendStatus.DRAINING, sources)
    aborted = {bid: registry.abort_in_flight(bid) for bid in ids} if abort else {}
    deadline = time.monotonic() + wait_s
    while True:
        in_flight = {bid: registry.in_flight(bid) for bid in ids}
        if not any(in_flight.values()) or time.monotonic() >= deadline:
            break
        sleep(POLL_S)
    return {"drained": not any(in_flight.values()), "in_flight": in_flight, "aborted": aborted}


def resume(registry: BackendRegistry, ids: list[str] | None, weight_version: str | None = None) -> list[str]:
    """Put ``ids`` (all backends when None) back in rotation, with ``weight_version`` if given."""
    ids = registry.resolve(ids)
    sources = [BackendStatus.DRAINING, BackendStatus.QUARANTINED, BackendStatus.ACTIVE]
    for bid in ids:
        if weight_version is not None:
            registry.set_fields(bid, weight_version=weight_version)
        registry.set_fields(bid, consecutive_failures=0)
        registry.set_status(bid, BackendStatus.ACTIVE, sources)
    return ids
