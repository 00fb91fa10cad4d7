"""``LLMPool.generate``: the one entry point the agent loop calls for a turn.

It picks a backend (``routing``: session affinity per job, priced by measured speed), holds an in-flight lease for the call, retries
failed calls on other backends with backoff (quarantining the backend that failed), waits while
every backend is draining or paused, and aborts the HTTP call as soon as ``should_stop()`` says so.
A turn that a weight update aborted with its tokens so far (token mode: ``PartialAborted``) is
not started again: the next call sends the prompt and those tokens, and the turn is their join,
each token with the version that sampled it (``Turn.weight_segments``).
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import redis

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.backoff import Backoff, wait
from prorl_celery.errors import (BackendAborted, BackendFailed, BackendUnavailable, LLMCallCancelled, LLMTimeout,
                                 PartialAborted)
from prorl_celery.llm.clients import client_for
from prorl_celery.llm.control import expire_pauses_now_and_then
from prorl_celery.llm.health import probe_quarantined, quarantine
from prorl_celery.llm.models import LLMRequest, Turn
from prorl_celery.llm.registry import BackendRegistry
from prorl_celery.llm.routing import _END, Router, Slot
from prorl_celery.llm.store import routing_redis
from prorl_celery.llm.transport import Call, CallAborted
from prorl_celery.redisio import LuaScript

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.1
DRAINING_POLL_S = 0.03
HELD_POLL_S = 0.2  # a call its project's quota or share holds looks again (many may wait: not too often)
MAX_BACKOFF_S = 8.0


def _never() -> bool:
    return False


_last_probe = 0.0
_probe_lock = threading.Lock()


def _probe_in_background(client: redis.Redis) -> None:
    """At most once per ``llm_probe_period_s`` per process, probe quarantined backends in a
    thread, so they come back even where no beat sweep runs and other backends carry the load."""
    global _last_probe
    period = get_settings().llm_probe_period_s
    with _probe_lock:
        if time.monotonic() - _last_probe < period:
            return
        _last_probe = time.monotonic()

    def run() -> None:
        try:
            probe_quarantined(client)
        except Exception:  # noqa: BLE001 - a failed probe pass is retried next period
            log.exception("background probe of quarantined LLM backends failed")

    threading.Thread(target=run, name="llm-probe", daemon=True).start()


_END_SCRIPT = LuaScript(_END)  # the routing's session end (Router.end_session)


def end_rollout(client: redis.Redis, job_id: str) -> None:
    """``LLMPool.end_rollout`` for callers without a pool (the run stage's end); never raises: a
    session not ended here stops counting after ``llm_session_idle_s``."""
    try:
        Router(client).end_session(job_id)
    except redis.RedisError as exc:
        log.warning("job %s: could not end its LLM session: %s", job_id, exc)


def end_rollout_on(client: redis.Redis, job_id: str) -> Callable[[object, bool], None] | None:
    """:func:`end_rollout` as commands for a pipeline of ``client`` (the head's), sent with the
    caller's (``JobStore.transition``'s ``after``: the run stage's done change) when the routing
    lives on that Redis; None when it has one of its own (then :func:`end_rollout`). Harmless to
    send twice (the session's key goes with the first); by digest first, with the script loaded
    when called ``again``."""
    if routing_redis(client) is not client:
        return None
    args = (keys.llm_sticky(job_id), keys.llm_sessions(""), job_id)

    def queue(pipe, again: bool) -> None:
        if again:
            _END_SCRIPT.whole(pipe, args[:1], args[1:])
        else:
            _END_SCRIPT.queue(pipe, args[:1], args[1:])

    return queue


class LLMPool:
    """``defer_release``: a successful call's in-flight lease is released only when the calling
    thread sends its deferred releases (:meth:`send_releases`, after it answered its own caller):
    one Redis round trip less on the path per call, for a caller whose latency is measured against
    direct calls (the session gateway). A caller that defers must send them."""

    def __init__(self, client: redis.Redis | None = None, defer_release: bool = False):
        if client is None:
            from prorl_celery.connections import get_redis

            client = get_redis()
        self.redis = client
        self.registry = BackendRegistry(client)
        self.router = Router(client)
        self.defer_release = defer_release

    def generate(self, job_id: str, request: LLMRequest,
                 should_stop: Callable[[], bool] | None = None) -> Turn:
        """Generate the next assistant turn of rollout ``job_id``.

        Raises LLMCallCancelled (should_stop fired), ContextWindowExceeded, LLMTimeout (a
        ``timeout_s`` shorter than ``llm_call_timeout_s`` passed), LLMRequestRejected (a 4xx
        other than the context window), BackendUnavailable (retry budget spent, or no
        backend registered / healthy within ``llm_no_backend_wait_s``)."""
        stop = should_stop or _never
        settings = get_settings()
        _probe_in_background(self.redis)
        protocol = request.protocol or (request.previous.protocol if request.previous else None)
        started, t0 = time.time(), time.monotonic()
        failures, attempts, waiting_since = 0, 0, None
        while True:
            if stop():
                raise LLMCallCancelled(f"LLM call of job {job_id} cancelled")
            slot = self.router.acquire(job_id, protocol)
            if isinstance(slot, str):
                waiting_since = waiting_since or time.monotonic()
                self._wait_for_backend(slot, stop, waiting_since, job_id)
                continue
            waiting_since = None
            attempts += 1
            try:
                turn = self._call(slot, request, stop)
            except CallAborted as exc:
                self.router.release(slot, "aborted")
                if exc.reason == "cancelled":
                    raise LLMCallCancelled(f"LLM call of job {job_id} cancelled") from None
                if exc.reason == "lost":  # drained with abort, removed, or lease lapsed: go again
                    log.info("job %s: lease on %s withdrawn; retrying", job_id, slot.backend.id)
                    continue
                timeout = request.timeout_s or settings.llm_call_timeout_s
                if timeout < settings.llm_call_timeout_s:  # the caller's deadline, not the backend's fault
                    raise LLMTimeout(f"LLM call of job {job_id} timed out after {timeout:.1f}s") from None
                late = BackendFailed(f"{slot.backend.address}: timed out after {timeout:.1f}s")
                failures = self._failed(slot, late, failures, stop)
            except PartialAborted as exc:  # a weight update cut the turn: go on from its ids once resumed
                self.router.release(slot, "aborted")
                request = request.model_copy(update={"partial": exc.partial})
                log.info("job %s: turn aborted on %s after %d tokens; continuing from them", job_id,
                         slot.backend.id, len(exc.partial.response_ids))
            except BackendAborted as exc:  # the server's own abort (weight update): go again, no quarantine
                self.router.release(slot, "aborted")
                failures = self._failed(slot, exc, failures, stop)
            except BackendFailed as exc:
                self.router.release(slot, "failed")
                failures = self._failed(slot, exc, failures, stop)
            except BaseException:
                self.router.release(slot, "aborted")
                raise
            else:
                self.router.release(slot, "ok", wait=not self.defer_release,
                                    tokens=len(turn.prompt_ids or ()) + len(turn.response_ids or ()))
                return turn.model_copy(update={"attempts": attempts, "started_at": started,
                                               "latency_s": time.monotonic() - t0})

    @staticmethod
    def send_releases() -> int:
        """Send this thread's deferred releases (``defer_release``) in one round trip."""
        return Router.send_deferred()

    def end_rollout(self, job_id: str) -> None:
        """Rollout ``job_id`` made its last call: its backend stops counting it as a session (its
        cached prefix is dead), so new rollouts fill that room at once."""
        self.router.end_session(job_id)

    def _call(self, slot: Slot, request: LLMRequest, stop: Callable[[], bool]) -> Turn:
        timeout = request.timeout_s or get_settings().llm_call_timeout_s
        with Call(timeout, should_stop=stop, lease=slot.lease) as call:
            return client_for(slot.backend.protocol).generate(slot, request, call)

    def _failed(self, slot: Slot, exc: BackendFailed, failures: int, stop: Callable[[], bool]) -> int:
        """Quarantine the backend (not for its own abort), and pause before the retry; raise once the
        budget is spent."""
        settings = get_settings()
        if not isinstance(exc, BackendAborted):
            quarantine(self.registry, slot.backend.id, str(exc))
        failures += 1
        if failures > settings.llm_retry_budget:
            raise BackendUnavailable(f"{failures} failed LLM calls (retry budget "
                                     f"{settings.llm_retry_budget}); last: {exc}") from exc
        pause = Backoff(settings.llm_backoff_s, MAX_BACKOFF_S, jitter=(0.75, 1.25)).pause(failures)
        log.warning("LLM call failed (%s); retry %d in %.1fs", exc, failures, pause)
        wait(pause, stop, WAIT_POLL_S)
        return failures

    def _wait_for_backend(self, reason: str, stop: Callable[[], bool], since: float, job_id: str) -> None:
        """Draining: wait for resume, or for the pause to expire (``llm_max_pause_s``). Quarantined:
        probe now. Nothing registered or nothing healthy: wait up to ``llm_no_backend_wait_s``."""
        settings = get_settings()
        if reason in ("quota", "share"):  # the project's quota, or its share of a full pool: cancellable
            wait(HELD_POLL_S * random.uniform(0.75, 1.25), stop, WAIT_POLL_S)
            if stop():
                raise LLMCallCancelled(f"LLM call of job {job_id} cancelled while held by its project's {reason}")
            return
        if reason == "quarantined":
            healthy = probe_quarantined(self.redis, min_interval_s=min(1.0, settings.llm_probe_period_s))
            if any(healthy.values()):
                return
        if reason != "draining" and time.monotonic() - since > settings.llm_no_backend_wait_s:
            what = "is registered" if reason == "none" else "is healthy"
            raise BackendUnavailable(f"no LLM backend {what} (waited {settings.llm_no_backend_wait_s:.0f}s)")
        # paused for a weight update: resumed within tens of ms, so look often (Redis takes the polls)
        if reason == "draining":
            if expire_pauses_now_and_then(self.registry):
                return
            wait(DRAINING_POLL_S, stop, DRAINING_POLL_S)
        else:
            wait(WAIT_POLL_S * 5, stop, WAIT_POLL_S)
        if stop():
            raise LLMCallCancelled(f"LLM call of job {job_id} cancelled while waiting for a backend")
