"""The sandboxes one host serves: capacity, leases, and the reaper that closes lapsed ones."""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from prorl_celery.errors import NoSandboxCapacity, SandboxGone
from sandboxes.base import ExecResult, Sandbox, SandboxSpec
from sandboxes.protocol import SandboxEntry
from sandboxes.registry import create_sandbox, runtime_name

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    sandbox_id: str
    job_id: str
    runtime: str
    sandbox: Sandbox
    lease_s: float
    created_at: float = field(default_factory=time.time)
    expires_at: float = 0.0
    wall_deadline: float | None = None
    busy: int = 0  # requests in flight; a busy sandbox's lease cannot lapse

    def renew(self, lease_s: float | None = None) -> None:
        self.lease_s = lease_s or self.lease_s
        self.expires_at = time.time() + self.lease_s


class SandboxPool:
    """Thread-safe table of live sandboxes. ``on_change`` is called after every create and close."""

    def __init__(self, host_id: str, capacity: int, default_lease_s: float,
                 runtime_config: dict[str, dict[str, Any]] | None = None,
                 on_change: Callable[[], None] | None = None):
        self.host_id = host_id
        self.capacity = capacity
        self.default_lease_s = default_lease_s
        self.runtime_config = runtime_config or {}
        self.on_change = on_change or (lambda: None)
        self._slots: dict[str, _Slot] = {}
        self._starting = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._slots) + self._starting

    def create(self, job_id: str, spec: SandboxSpec, lease_s: float | None = None) -> SandboxEntry:
        with self._lock:
            if len(self._slots) + self._starting >= self.capacity:
                raise NoSandboxCapacity(f"host {self.host_id} is full ({self.capacity} sandboxes)")
            self._starting += 1  # reserve the slot; starting a sandbox can be slow
        try:
            name = runtime_name(spec)
            sandbox = create_sandbox(spec, job_id, self.runtime_config.get(name))
        finally:
            with self._lock:
                self._starting -= 1
        slot = _Slot(secrets.token_hex(8), job_id, name, sandbox, lease_s or self.default_lease_s)
        slot.renew()
        if spec.limits.wall_s:
            slot.wall_deadline = slot.created_at + spec.limits.wall_s
        with self._lock:
            self._slots[slot.sandbox_id] = slot
        self.on_change()
        return self.entry(slot)

    def entry(self, slot: _Slot) -> SandboxEntry:
        info = slot.sandbox.info()
        return SandboxEntry(sandbox_id=slot.sandbox_id, host_id=self.host_id, job_id=slot.job_id,
                            runtime=slot.runtime, created_at=slot.created_at,
                            expires_at=slot.expires_at, lease_s=slot.lease_s, pid=info.get("pid"),
                            info=info)

    def entries(self) -> list[SandboxEntry]:
        with self._lock:
            slots = list(self._slots.values())
        return [self.entry(slot) for slot in slots]

    @contextmanager
    def using(self, sandbox_id: str) -> Iterator[Sandbox]:
        """The sandbox, held busy (its lease cannot lapse) until the block ends, then renewed."""
        with self._lock:
            slot = self._slots.get(sandbox_id)
            if slot is None:
                raise SandboxGone(f"no sandbox {sandbox_id!r} on host {self.host_id}")
            slot.busy += 1
            slot.renew()
        try:
            yield slot.sandbox
        finally:
            with self._lock:
                slot.busy -= 1
                slot.renew()

    def exec(self, sandbox_id: str, command: str, timeout: float | None) -> ExecResult:
        with self.using(sandbox_id) as sandbox:
            return sandbox.exec(command, timeout)

    def renew(self, sandbox_id: str, lease_s: float | None = None) -> SandboxEntry:
        with self._lock:
            slot = self._slots.get(sandbox_id)
            if slot is None:
                raise SandboxGone(f"no sandbox {sandbox_id!r} on host {self.host_id}")
            slot.renew(lease_s)
        return self.entry(slot)

    def close(self, sandbox_id: str, reason: str = "closed") -> bool:
        with self._lock:
            slot = self._slots.pop(sandbox_id, None)
        if slot is None:
            return False
        log.info("closing sandbox %s of job %s: %s", sandbox_id, slot.job_id, reason)
        try:
            slot.sandbox.close()
        except Exception:
            log.exception("closing sandbox %s failed", sandbox_id)
        self.on_change()
        return True

    def close_all(self) -> int:
        with self._lock:
            ids = list(self._slots)
        return sum(self.close(sandbox_id, "host shutting down") for sandbox_id in ids)

    def reap(self, now: float | None = None) -> list[str]:
        """Close sandboxes whose lease lapsed (unless busy) or whose wall time ran out."""
        now = now or time.time()
        doomed: list[tuple[str, str]] = []
        with self._lock:
            for slot in self._slots.values():
                if slot.wall_deadline and now >= slot.wall_deadline:
                    doomed.append((slot.sandbox_id, "wall time limit"))
                elif slot.busy:
                    slot.renew()  # a long command keeps its own lease alive
                elif now >= slot.expires_at:
                    doomed.append((slot.sandbox_id, "lease lapsed"))
        return [sandbox_id for sandbox_id, why in doomed if self.close(sandbox_id, why)]

    def start_reaper(self, interval_s: float = 1.0) -> threading.Thread:
        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.reap()
                except Exception:
                    log.exception("reaper pass failed")

        thread = threading.Thread(target=loop, name="sandbox-reaper", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
