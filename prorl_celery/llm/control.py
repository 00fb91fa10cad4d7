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

A pause expires: a trainer that dies between pause and resume would otherwise hold every rollout
forever. Each paused backend records when its pause ends (``paused_until``: ``llm_max_pause_s``,
or the request's shorter ``max_pause_s``); past it, the first turn waiting for it resumes the
backend (:func:`expire_pauses`) on the weight version it had, and the backend says so
(``pause_expired_at``, and a warning in the log). A resume that comes later still names the new
version and resumes as usual.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.errors import BackendFailed, UnknownBackend
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
          sleep: Callable[[float], None] = time.sleep, max_pause_s: float | None = None) -> dict:
    """Pause ``ids`` (all when None) for a weight update, for at most ``max_pause_s`` (never
    longer than the operator's ``llm_max_pause_s``); see the module docstring. Returns
    ``{"safe", "pause_s", "modes", "server_s", "in_flight", "errors", "max_pause_s", "expires_at"}``."""
    started = time.monotonic()
    limit = get_settings().llm_max_pause_s
    max_pause_s = min(max_pause_s, limit) if max_pause_s is not None else limit
    expires_at = time.time() + max_pause_s
    backends = registry.get_many(registry.resolve(ids))
    modes = {b.id: effective_mode(b, mode) for b in backends}
    for b in backends:  # the router holds new turns from now on
        if registry.write(b.id, fields={"paused_mode": modes[b.id], "paused_until": expires_at},
                          unset=["pause_expired_at"], status=(BackendStatus.DRAINING, PAUSE_SOURCES)) == -1:
            raise UnknownBackend(b.id)
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
            "server_s": server_s, "in_flight": in_flight, "errors": errors, "max_pause_s": max_pause_s,
            "expires_at": expires_at}


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


def resume(registry: BackendRegistry, ids: list[str] | None, weight_version: str | None = None,
           project: str | None = None) -> list[str]:
    """Put ``ids`` (all backends when None) back in rotation, with ``weight_version`` if given:
    a server paused by its own API is told the new version, then resumed (its frozen turns go on);
    the version becomes the current one for the staleness bound (of ``project``'s rollouts; None:
    the operator's)."""
    ids = registry.resolve(ids)
    sources = [BackendStatus.DRAINING, BackendStatus.QUARANTINED, BackendStatus.ACTIVE]
    if weight_version is not None:
        WeightVersions(registry.head, project).advance(weight_version)
    for backend in registry.get_many(ids):
        registry.clear_fields(backend.id, "paused_until")  # no expiry after this: it is resumed
        _resume_one(registry, backend, weight_version, sources)
    return ids


def _resume_one(registry: BackendRegistry, backend: Backend, weight_version: str | None,
                sources: list[BackendStatus]) -> None:
    if backend.pause_api not in (None, "none") and (backend.paused_mode in ("keep", "abort")
                                                      or weight_version is not None):
        try:
            resume_server(backend, weight_version, registry.api_key(backend.id))
        except BackendFailed as exc:  # its turns would stay frozen: the health check takes it from here
            log.warning("backend %s: resuming the server failed: %s", backend.id, exc)
    registry.reactivate(backend.id, weight_version, sources)


EXPIRY_CHECK_S = 0.5  # how often one process looks for expired pauses while its turns wait
_last_check = 0.0


def expire_pauses(registry: BackendRegistry, now: float | None = None) -> list[str]:
    """Resume, on the weight version they had, the paused backends whose pause is past its
    ``paused_until`` with no resume; each records ``pause_expired_at``. Returns their ids."""
    now = time.time() if now is None else now
    expired = []
    for backend in registry.get_many(registry.resolve(None)):
        if backend.status is not BackendStatus.DRAINING or backend.paused_until is None or backend.paused_until > now:
            continue
        raw = registry.redis.hget(keys.llm_backend(backend.id), "paused_until")
        if raw is None or not registry.claim_pause_expiry(backend.id, raw):
            continue  # resumed meanwhile, or another turn expires it
        log.warning("backend %s: paused since %.0f s with no resume (max_pause_s): resuming it on weight version %s",
                    backend.id, now - backend.status_since, backend.weight_version)
        _resume_one(registry, backend, None, [BackendStatus.DRAINING])
        registry.set_fields(backend.id, pause_expired_at=now)
        expired.append(backend.id)
    return expired


def expire_pauses_now_and_then(registry: BackendRegistry) -> list[str]:
    """:func:`expire_pauses` at most every ``EXPIRY_CHECK_S`` in this process (called by each
    turn that waits on a paused backend: many wait at once, and the pause usually ends by resume)."""
    global _last_check
    if time.monotonic() - _last_check < EXPIRY_CHECK_S:
        return []
    _last_check = time.monotonic()
    return expire_pauses(registry)
