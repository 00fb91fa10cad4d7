"""Checkpoint swaps: pause backends around a weight update and resume them with a new weight
version, without losing a turn.

``pause(mode)`` per backend (:func:`prorl_celery.llm.pause.effective_mode`): ``keep`` — the
server freezes its turns in place and they go on after resume on the new weights; ``abort`` —
the server ends them with their tokens so far, and each turn goes on from those tokens once
resumed (abort-and-continue, :mod:`prorl_celery.llm.pool`); ``drain`` — no new requests, and the
ones in flight finish. Either way the router holds new turns until resume. ``pause`` returns
when it is safe to write weights: at once after the servers' own pause answered, after the
drained ones finished (or ``wait_s`` ran out: ``safe`` false). A server whose pause fails is drained.
A server with no pause of its own whose answers are streamed (llama.cpp) is aborted by the
service: the leases of its calls are withdrawn, each call cuts its stream within the lease
keeper's check period and keeps the tokens that came; ``pause`` returns after that period.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from prorl_celery.errors import BackendFailed
from prorl_celery.leases import CALL_CHECK_S, TICK_S
from prorl_celery.llm.models import Backend, BackendStatus, PauseApi
from prorl_celery.llm.pause import Mode, effective_mode, pause_server, resume_server
from prorl_celery.llm.registry import BackendRegistry
from prorl_celery.staleness import WeightVersions

log = logging.getLogger(__name__)
POLL_S = 0.05
PAUSE_SOURCES = [BackendStatus.ACTIVE, BackendStatus.QUARANTINED, BackendStatus.DRAINING]


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
    in_flight = _wait_in_flight(registry, ids, wait_s, sleep)
    return {"drained": not any(in_flight.values()), "in_flight": in_flight, "aborted": aborted}


def _wait_in_flight(registry: BackendRegistry, ids: list[str], wait_s: float,
                    sleep: Callable[[float], None]) -> dict[str, int]:
    """Wait until nothing is in flight on ``ids`` or ``wait_s`` ran out; what is still in flight."""
    deadline = time.monotonic() + wait_s
    while True:
        in_flight = {bid: registry.in_flight(bid) for bid in ids}
        if not any(in_flight.values()) or time.monotonic() >= deadline:
            return in_flight
        sleep(POLL_S)


def pause(registry: BackendRegistry, ids: list[str] | None, mode: Mode, wait_s: float,
          sleep: Callable[[float], None] = time.sleep) -> dict:
    """Pause ``ids`` (all when None) for a weight update; see the module docstring. Returns
    ``{"safe", "pause_s", "modes", "server_s", "in_flight", "errors"}``."""
    started = time.monotonic()
    backends = registry.get_many(registry.resolve(ids))
    modes = {b.id: effective_mode(b, mode) for b in backends}
    for b in backends:  # the router holds new turns from now on
        registry.set_status(b.id, BackendStatus.DRAINING, PAUSE_SOURCES)
        registry.set_fields(b.id, paused_mode=modes[b.id])
    own = [b for b in backends if modes[b.id] != "drain" and b.pause_api not in (None, PauseApi.NONE)]
    cut = [b for b in backends if modes[b.id] == "abort" and b.pause_api in (None, PauseApi.NONE)]
    server_s, errors = _pause_servers(registry, own, modes)
    if cut:  # the service's own abort: each call sees its lease gone and cuts its stream
        for b in cut:
            registry.abort_in_flight(b.id)
        sleep(CALL_CHECK_S + 2 * TICK_S)
    for bid in errors:
        modes[bid] = "drain"
        registry.set_fields(bid, paused_mode="drain")
    drained = [bid for bid, m in modes.items() if m == "drain"]
    in_flight = _wait_in_flight(registry, drained, wait_s, sleep)
    return {"safe": not any(in_flight.values()), "pause_s": time.monotonic() - started, "modes": modes,
            "server_s": server_s, "in_flight": in_flight, "errors": errors}


def _pause_servers(registry: BackendRegistry, backends: list[Backend], modes: dict[str, Mode]
                   ) -> tuple[dict[str, float], dict[str, str]]:
    """Each server's own pause, all at once; (seconds each took, errors of those that failed)."""
    if not backends:
        return {}, {}
    server_s, errors = {}, {}
    with ThreadPoolExecutor(max_workers=min(16, len(backends))) as threads:
        futures = {b.id: threads.submit(pause_server, b, modes[b.id], registry.api_key(b.id)) for b in backends}
        for bid, future in futures.items():
            try:
                server_s[bid] = future.result()
            except BackendFailed as exc:
                log.warning("backend %s: its own pause failed (%s); drained instead", bid, exc)
                errors[bid] = str(exc)
    return server_s, errors


def resume(registry: BackendRegistry, ids: list[str] | None, weight_version: str | None = None) -> list[str]:
    """Put ``ids`` (all backends when None) back in rotation, with ``weight_version`` if given:
    a server paused by its own API is told the new version, then resumed (its frozen turns go on);
    the version becomes the current one for the staleness bound."""
    ids = registry.resolve(ids)
    sources = [BackendStatus.DRAINING, BackendStatus.QUARANTINED, BackendStatus.ACTIVE]
    if weight_version is not None:
        WeightVersions(registry.redis).advance(weight_version)
    for backend in registry.get_many(ids):
        if backend.pause_api not in (None, "none") and (backend.paused_mode in ("keep", "abort")
                                                          or weight_version is not None):
            try:
                resume_server(backend, weight_version, registry.api_key(backend.id))
            except BackendFailed as exc:  # its turns would stay frozen: the health check takes it from here
                log.warning("backend %s: resuming the server failed: %s", backend.id, exc)
        registry.reactivate(backend.id, weight_version, sources)
    return ids
