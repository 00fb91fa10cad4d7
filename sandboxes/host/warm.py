"""Sandboxes started ahead of demand, so that ``create`` hands out one that is already running.

A runtime takes part through two hooks of :class:`~sandboxes.base.SandboxRuntime`:
``warm_spec(spec) -> SandboxSpec | None`` (the part of a spec that must be fixed when the sandbox
starts: image, network; None, the default, when it cannot be pre-started) and ``claim(job_id,
spec)`` (applies the rest: environment, limits, working directory). Sandboxes
are kept per (runtime, warm spec) that has been asked for at least once, ``per_key`` of each,
refilled by one background thread. They do not count against the host's capacity. The pool
starts only what the host admitted (:meth:`sandboxes.host.pool.SandboxPool.admit`): the runtime by its
served name, never re-resolved from the spec.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sandboxes.base import Sandbox, SandboxSpec
from sandboxes.registry import load_runtime

log = logging.getLogger(__name__)
WARM_JOB = "warm"


class WarmPool:
    def __init__(self, per_key: int, config_for: Callable[[str], dict[str, Any] | None]):
        self.per_key = per_key
        self.config_for = config_for
        self._ready: dict[tuple[str, str], list[Sandbox]] = {}
        self._templates: dict[tuple[str, str], tuple[str, SandboxSpec]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _key(self, name: str, spec: SandboxSpec) -> tuple[tuple[str, str], SandboxSpec] | None:
        template = load_runtime(name).warm_spec(spec)
        return None if template is None else ((name, template.model_dump_json()), template)

    def take(self, name: str, spec: SandboxSpec, job_id: str) -> Sandbox | None:
        """A running sandbox made ready for ``job_id`` and ``spec``, or None (start one cold)."""
        if self.per_key <= 0 or self._stop.is_set():
            return None
        keyed = self._key(name, spec)
        if keyed is None:
            return None
        key, template = keyed
        with self._lock:
            self._templates.setdefault(key, (name, template))
            ready = self._ready.setdefault(key, [])
            sandbox = ready.pop() if ready else None
        self._wake.set()
        if sandbox is None:
            return None
        try:
            sandbox.claim(job_id, spec)
            return sandbox
        except Exception as exc:  # noqa: BLE001 - a stale warm sandbox: start one cold instead
            log.warning("warm %s sandbox could not be claimed (%s); starting a new one", name, exc)
            sandbox.close()
            return None

    def _missing(self) -> list[tuple[tuple[str, str], str, SandboxSpec]]:
        with self._lock:
            return [(key, name, template) for key, (name, template) in self._templates.items()
                    if len(self._ready.get(key, [])) < self.per_key]

    def fill_once(self) -> int:
        """Start what is missing; returns how many were started."""
        started = 0
        while not self._stop.is_set() and (missing := self._missing()):
            key, name, template = missing[0]
            try:
                sandbox = load_runtime(name)(template, WARM_JOB, self.config_for(name))
            except Exception as exc:  # noqa: BLE001 - stop warming this key, keep serving cold
                log.warning("could not pre-start a %s sandbox: %s", name, exc)
                with self._lock:
                    self._templates.pop(key, None)
                continue
            with self._lock:
                if self._stop.is_set():
                    sandbox.close()
                    break
                self._ready.setdefault(key, []).append(sandbox)
            started += 1
        return started

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                self._wake.wait(5.0)
                self._wake.clear()
                self.fill_once()

        self._thread = threading.Thread(target=loop, name="sandbox-warm-pool", daemon=True)
        self._thread.start()

    def idle(self) -> list[Sandbox]:
        with self._lock:
            return [sandbox for ready in self._ready.values() for sandbox in ready]

    def close_all(self) -> int:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            doomed = [sandbox for ready in self._ready.values() for sandbox in ready]
            self._ready.clear()
        for sandbox in doomed:
            sandbox.close()
        return len(doomed)
