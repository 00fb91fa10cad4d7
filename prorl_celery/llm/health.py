"""Quarantine of failing backends and the probes that bring them back.

A backend whose call failed (connection error, 5xx, timeout) leaves the rotation at once and is
probed (``GET /health``, else ``GET /v1/models``) every ``llm_probe_period_s`` until it answers.
``probe_quarantined`` is what the beat sweep calls; the pool also calls it on demand when a
request finds nothing else to use. ``drop_unanswering`` forgets the backends that do not answer
at all (``prorl-celery up`` on the state directory of an earlier run: its servers are gone).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import redis

from config.settings import get_settings
from prorl_celery import http, keys
from prorl_celery.errors import UnknownBackend
from prorl_celery.llm.models import Backend, BackendStatus
from prorl_celery.llm.registry import BackendRegistry

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 3.0


def quarantine(registry: BackendRegistry, backend_id: str, error: str) -> bool:
    """Take an active backend out of rotation; returns True if this call did it."""
    try:
        registry.set_fields(backend_id, last_error=error[:500])
        changed = registry.set_status(backend_id, BackendStatus.QUARANTINED, [BackendStatus.ACTIVE])
    except UnknownBackend:
        return False
    if changed:
        registry.set_fields(backend_id, probed_at=time.time())
        log.warning("LLM backend %s quarantined: %s", backend_id, error)
    return changed


def probe(address: str, api_key: str | None = None, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None if the server answers ``/health`` or ``/v1/models`` with 200, else what went wrong.
    On the service's one HTTP stack: the probing thread keeps its connection to the server."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    error = "no answer"
    for path in ("/health", "/v1/models"):
        try:
            status = http.request("GET", f"{address}{path}", timeout=timeout, headers=headers).status_code
        except (http.TransportError, ValueError) as exc:  # ValueError: an address with a bad port
            return f"{type(exc).__name__}: {exc}"  # the server is not there; no point in a 2nd path
        if status == 200:
            return None
        error = f"GET {path} -> {status}"
    return error


def probe_quarantined(client: redis.Redis, min_interval_s: float | None = None) -> dict[str, bool]:
    """Probe every quarantined backend not probed in the last ``min_interval_s`` (default
    ``llm_probe_period_s``; 0 probes all); re-activate those that answer. Returns backend id ->
    healthy for the ones probed."""
    registry = BackendRegistry(client)
    client = registry.redis  # the routing's Redis: the backends, their probe locks
    interval = get_settings().llm_probe_period_s if min_interval_s is None else min_interval_s
    now = time.time()
    results: dict[str, bool] = {}
    for backend in registry.list():
        if backend.status is not BackendStatus.QUARANTINED:
            continue
        probed_at = float(client.hget(keys.llm_backend(backend.id), "probed_at") or 0)
        if now - probed_at < interval:
            continue
        lock = keys.llm_probe_lock(backend.id)
        if not client.set(lock, "1", nx=True, px=int(PROBE_TIMEOUT_S * 2000)):
            continue  # someone else is probing it right now
        try:
            results[backend.id] = _probe_one(registry, backend)
        finally:
            client.delete(lock)
    return results


def _probe_one(registry: BackendRegistry, backend: Backend) -> bool:
    api_key = registry.redis.hget(keys.llm_backend(backend.id), "api_key")
    error = probe(backend.address, api_key.decode() if api_key else None)
    try:
        registry.set_fields(backend.id, probed_at=time.time())
        if error is None:
            if registry.set_status(backend.id, BackendStatus.ACTIVE, [BackendStatus.QUARANTINED]):
                registry.set_fields(backend.id, consecutive_failures=0)
                log.info("LLM backend %s answers again; back in rotation", backend.id)
            return True
        log.info("LLM backend %s still down: %s", backend.id, error)  # last_error keeps the cause
    except UnknownBackend:
        pass
    return False


def drop_unanswering(client: redis.Redis, routing: redis.Redis | None = None,
                     timeout_s: float = PROBE_TIMEOUT_S) -> list[tuple[str, str, str]]:
    """Probe every registered backend at once and remove those that do not answer; returns
    ``(id, address, error)`` of each removed. For a registry that outlived its servers (a
    backend kept would be routed to, fail, and be probed for ever), not for a live cluster's:
    there a backend down for a moment is quarantined and comes back. ``routing``: the routing's
    own Redis (default: ``routing_url``'s, else ``client``)."""
    registry = BackendRegistry(client, routing)
    backends = registry.list()
    if not backends:
        return []
    with ThreadPoolExecutor(min(16, len(backends))) as pool:
        errors = list(pool.map(lambda b: probe(b.address, registry.api_key(b.id), timeout_s), backends))
    dropped = []
    for backend, error in zip(backends, errors):
        if error is None:
            continue
        try:
            registry.remove(backend.id)
        except UnknownBackend:
            continue
        log.info("LLM backend %s (%s) dropped: no answer (%s)", backend.id, backend.address, error)
        dropped.append((backend.id, backend.address, error))
    return dropped
