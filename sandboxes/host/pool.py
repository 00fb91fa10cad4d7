"""The sandboxes one host serves: capacity, leases, and the reaper that closes lapsed ones."""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from prorl_celery.errors import InvalidRequest, NoSandboxCapacity, PolicyDenied, SandboxGone
from sandboxes.base import ExecResult, Sandbox, SandboxSpec
from sandboxes.host.forward import Forward, forward
from sandboxes.host.relay import Relay, is_socket, parse_target, socket_path
from sandboxes.protocol import RelayResponse, SandboxEntry, SandboxUsage, combine_usage
from sandboxes import policy
from sandboxes.registry import ServedRuntimes, isolation_of, load_runtime, requested_runtime
from sandboxes.host.warm import WarmPool
from sandboxes.runtimes.limits import exitboost

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
    policy: dict[str, Any] = field(default_factory=dict)  # what the host decided, for info()
    relays: dict[str, Relay] = field(default_factory=dict)  # socket name -> its relay (harness sessions)
    keeper: str | None = None  # the sandbox this one lives and dies with (a task's sidecar: the agent's)
    forwards: list[tuple[str, Forward]] = field(default_factory=list)  # (target id, forward) listened on here

    def renew(self, lease_s: float | None = None) -> None:
        self.lease_s = lease_s or self.lease_s
        self.expires_at = time.time() + self.lease_s


class SandboxPool:
    """Thread-safe table of live sandboxes. ``on_change`` is called after every create and close.

    ``create`` takes a pre-started sandbox from the warm pool when one fits. ``close`` kills the
    sandbox's processes and moves its workspace aside before it returns (its ``kill()`` hook; by
    default that closes it at once); reaping the processes and deleting the files finish in the
    background.
    """

    def __init__(self, host_id: str, capacity: int, default_lease_s: float,
                 runtime_config: dict[str, dict[str, Any]] | None = None,
                 on_change: Callable[[], None] | None = None, warm: int = 0,
                 served: ServedRuntimes | None = None):
        self.host_id = host_id
        self.served = served or ServedRuntimes(None, runtime_config)
        self.capacity = capacity
        self.default_lease_s = default_lease_s
        self.runtime_config = runtime_config or {}
        self.on_change = on_change or (lambda: None)
        self._slots: dict[str, _Slot] = {}
        self._watched: dict[object, tuple[Callable[[], bool], Sandbox]] = {}
        self._starting = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.warm = WarmPool(warm, lambda name: self.runtime_config.get(name))
        self._teardown = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sandbox-teardown")
        self._starts = threading.BoundedSemaphore(start_concurrency())
        self._pending: set[Future] = set()

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._slots) + self._starting

    def admit(self, spec: SandboxSpec) -> tuple[str, SandboxSpec]:
        """The served runtime and the spec as the operator's policy lets it run: the runtime
        must be one this host serves, the image a registered one, the limits under the ceilings.
        Raises :class:`~prorl_celery.errors.PolicyDenied` naming the field."""
        name = self.served.select(requested_runtime(spec))
        image = policy.check_image(spec.image, "spec.image")
        return name, policy.clamp_spec(spec).model_copy(update={"runtime": name, "image": image})

    def create(self, job_id: str, spec: SandboxSpec, lease_s: float | None = None,
               keeper: str | None = None) -> SandboxEntry:
        """A new sandbox; with ``keeper`` (a live sandbox of this host and job) one that shares
        its lifetime: held while the keeper lives, closed with it."""
        name, spec = self.admit(spec)
        with self._lock:
            if keeper is not None:
                self._slot_of(keeper, job_id, "keeper")
            if len(self._slots) + self._starting >= self.capacity:
                raise NoSandboxCapacity(f"host {self.host_id} is full ({self.capacity} sandboxes)")
            self._starting += 1  # reserve the slot; starting a sandbox can be slow
        try:
            sandbox = self.warm.take(name, spec, job_id)
            if sandbox is None:
                with self._starts:  # a few at a time: see settings.sandbox_start_concurrency
                    sandbox = load_runtime(name)(spec, job_id, self.runtime_config.get(name))
        finally:
            with self._lock:
                self._starting -= 1
        slot = _Slot(secrets.token_hex(8), job_id, name, sandbox, lease_s or self.default_lease_s, keeper=keeper)
        slot.renew()
        slot.policy = {"isolation": isolation_of(name), "limits": spec.limits.model_dump(exclude_none=True),
                       "limit_enforcement": limit_enforcement()}
        if spec.limits.wall_s:
            slot.wall_deadline = slot.created_at + spec.limits.wall_s
        with self._lock:
            kept = keeper is None or keeper in self._slots
            if kept:
                self._slots[slot.sandbox_id] = slot
        if not kept:  # the keeper closed while this one started
            _close(sandbox, slot.sandbox_id)
            raise SandboxGone(f"no sandbox {keeper!r} on host {self.host_id} (the keeper closed)")
        self.on_change()
        return self.entry(slot)

    def _slot_of(self, sandbox_id: str, job_id: str, field_name: str) -> _Slot:
        """The live slot ``sandbox_id`` of job ``job_id`` (the caller holds the lock)."""
        slot = self._slots.get(sandbox_id)
        if slot is None:
            raise SandboxGone(f"no sandbox {sandbox_id!r} on host {self.host_id}")
        if slot.job_id != job_id:
            raise PolicyDenied(f"sandbox {sandbox_id} is another job's", field=field_name)
        return slot

    def entry(self, slot: _Slot) -> SandboxEntry:
        info = slot.sandbox.info()
        for key, value in slot.policy.items():  # the runtime's own account comes first
            info.setdefault(key, value)
        return SandboxEntry(sandbox_id=slot.sandbox_id, host_id=self.host_id, job_id=slot.job_id,
                            runtime=slot.runtime, created_at=slot.created_at,
                            expires_at=slot.expires_at, lease_s=slot.lease_s, pid=info.get("pid"),
                            info=info, keeper=slot.keeper)

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

    def exec(self, sandbox_id: str, command: str, timeout: float | None,
             caller_gone: Callable[[], bool] | None = None) -> ExecResult:
        """Run a command; when ``caller_gone()`` turns true (checked by the reaper) the
        command is interrupted, so a dead worker's command does not hold the sandbox."""
        with self.using(sandbox_id) as sandbox:
            key = object()
            if caller_gone is not None:
                self._watched[key] = (caller_gone, sandbox)
            try:
                return sandbox.exec(command, timeout)
            finally:
                self._watched.pop(key, None)

    def renew(self, sandbox_id: str, lease_s: float | None = None) -> SandboxEntry:
        with self._lock:
            slot = self._slots.get(sandbox_id)
            if slot is None:
                raise SandboxGone(f"no sandbox {sandbox_id!r} on host {self.host_id}")
            slot.renew(lease_s)
        return self.entry(slot)

    def relay(self, sandbox_id: str, socket: str, target: str | None = None,
              close: bool = False, key: str | None = None) -> RelayResponse:
        """The way out of ``sandbox_id`` to a harness session's gateway (:mod:`sandboxes.host.relay`):
        whether the socket ``socket`` is on this node already, else a relay of it to ``target``
        (kept until closed, or until the sandbox is), proving ``key`` (the session's relay key) to
        the gateway at each connection."""
        path = socket_path(socket)
        with self._lock:
            slot = self._slots.get(sandbox_id)
            if slot is None:
                raise SandboxGone(f"no sandbox {sandbox_id!r} on host {self.host_id}")
            if close:
                relay = slot.relays.pop(socket, None)
            elif socket in slot.relays:
                return RelayResponse(route="relay", path=path)
        if close:
            if relay is not None:
                relay.close()
            return RelayResponse(route="closed", path=path)
        if is_socket(path):  # the session's gateway is on this node: the sandbox reaches it itself
            return RelayResponse(route="direct", path=path)
        if target is None:
            return RelayResponse(route="none", path=path)
        address = parse_target(target)
        if key is None:
            raise InvalidRequest("a relay needs the session's relay key", field="key")
        relay = Relay(path, address, bytes.fromhex(key))
        with self._lock:
            if self._slots.get(sandbox_id) is slot:
                slot.relays[socket] = relay
                relay = None
        if relay is not None:  # the sandbox closed meanwhile
            relay.close()
            raise SandboxGone(f"no sandbox {sandbox_id!r} on host {self.host_id}")
        log.info("sandbox %s of job %s: gateway socket %s relayed to %s", sandbox_id, slot.job_id, socket[:8], target)
        return RelayResponse(route="relay", path=path)

    def forward(self, sandbox_id: str, to: str, ports: list[int]) -> list[int]:
        """``ports`` of the sandbox ``to`` (the same job's, on this host) listened on at 127.0.0.1
        in ``sandbox_id``'s network namespace (:mod:`sandboxes.host.forward`), until either closes."""
        if any(not 0 < port < 65536 for port in ports):
            raise InvalidRequest(f"not TCP ports: {ports}", field="ports")
        with self._lock:
            slot = self._slots.get(sandbox_id)
            if slot is None:
                raise SandboxGone(f"no sandbox {sandbox_id!r} on host {self.host_id}")
            target = self._slot_of(to, slot.job_id, "to")
            slot.busy += 1
            target.busy += 1
        try:
            made = forward(slot.sandbox, target.sandbox, ports)
        finally:
            with self._lock:
                slot.busy -= 1
                target.busy -= 1
        with self._lock:
            alive = self._slots.get(sandbox_id) is slot and self._slots.get(to) is target
            if alive:
                slot.forwards.append((to, made))
        if not alive:
            made.close()
            raise SandboxGone(f"sandbox {sandbox_id} or {to} closed while its forward started")
        log.info("sandbox %s of job %s: ports %s of sandbox %s forwarded in", sandbox_id, slot.job_id, ports, to)
        return made.ports

    def close(self, sandbox_id: str, reason: str = "closed") -> bool:
        return bool(self.close_many([sandbox_id], reason))

    def close_measured(self, sandbox_id: str, reason: str = "closed") -> tuple[bool, SandboxUsage | None]:
        """:meth:`close`, and what the sandbox and its sidecars used (read just before the kill:
        :meth:`~sandboxes.base.SandboxRuntime.usage`); None when not measured or already gone."""
        readings: dict[str, Any] = {}
        closed = self.close_many([sandbox_id], reason, readings)
        return bool(closed), combine_usage(list(readings.values()))

    def usage(self, sandbox_id: str) -> SandboxUsage | None:
        """What a live sandbox (and its sidecars) used so far: a reading on demand (``info``)."""
        with self._lock:
            if sandbox_id not in self._slots:
                raise SandboxGone(f"no sandbox {sandbox_id!r} on host {self.host_id}")
            boxes = [s.sandbox for s in self._slots.values() if sandbox_id in (s.sandbox_id, s.keeper)]
        return combine_usage([_usage_of(box) for box in boxes])

    def close_many(self, sandbox_ids: list[str], reason: str = "closed",
                   readings: dict[str, Any] | None = None) -> list[str]:
        """Close several; returns those it closed. Every sandbox is killed (its ``kill()`` hook)
        before any teardown is queued: killed and closed one by one, each kill's syscalls waited
        for the GIL behind the exec threads the earlier kills had woken (bench/RESULTS.md, bulk
        cancel). Their exits are hastened (each one's ``hasten_exit()`` before the kills, then
        :func:`~sandboxes.runtimes.limits.exitboost.commit`), and one line is logged. With
        ``readings``, each closing sandbox's usage is read into it first (a bulk close reads none)."""
        with self._lock:
            slots = [slot for i in sandbox_ids if (slot := self._slots.pop(i, None)) is not None]
            closing = {slot.sandbox_id for slot in slots}
            while kept := [s for s in self._slots.values() if s.keeper in closing]:  # sidecars go with their keeper
                for slot in kept:
                    slots.append(self._slots.pop(slot.sandbox_id))
                    closing.add(slot.sandbox_id)
            ends = [f for slot in slots for _to, f in slot.forwards]  # forwards out of or into a closing one
            for slot in self._slots.values():
                ends += [f for to, f in slot.forwards if to in closing]
                slot.forwards = [(to, f) for to, f in slot.forwards if to not in closing]
        if readings is not None:  # the last reading of a live group: its processes still run
            readings.update((slot.sandbox_id, _usage_of(slot.sandbox)) for slot in slots)
        for slot in slots:  # before any kill: no dying sandbox competes with these writes yet
            try:
                slot.sandbox.hasten_exit()
            except Exception:
                log.exception("could not hasten the exit of sandbox %s", slot.sandbox_id)
        for slot in slots:  # nothing else in this loop: a log line's write lets other threads in
            try:
                slot.sandbox.kill()
            except Exception:
                log.exception("killing sandbox %s failed", slot.sandbox_id)
        exitboost.commit()
        for slot in slots:  # its harness sessions' ways out go with it
            for relay in slot.relays.values():
                relay.close()
        for made in ends:
            made.close()
        if len(slots) == 1:
            log.info("closing sandbox %s of job %s: %s", slots[0].sandbox_id, slots[0].job_id, reason)
        elif slots:
            log.info("closing %d sandboxes (%s): %s", len(slots), reason,
                     " ".join(f"{slot.sandbox_id}/{slot.job_id}" for slot in slots))
        for slot in slots:
            future = self._teardown.submit(_close, slot.sandbox, slot.sandbox_id)
            with self._lock:
                self._pending.add(future)
            future.add_done_callback(self._pending.discard)
        if slots:
            self.on_change()
        return [slot.sandbox_id for slot in slots]

    def drain(self, timeout: float = 30.0) -> None:
        """Wait for background teardowns to finish."""
        with self._lock:
            pending = list(self._pending)
        wait(pending, timeout=timeout)

    def close_all(self) -> int:
        with self._lock:
            ids = list(self._slots)
        closed = len(self.close_many(ids, "host shutting down"))
        self.warm.close_all()
        self.drain()
        return closed

    def interrupt_abandoned(self) -> int:
        """Interrupt running commands whose caller hung up."""
        hung_up = [sandbox for gone, sandbox in list(self._watched.values()) if gone()]
        for sandbox in hung_up:
            log.info("interrupting a command whose caller disconnected")
            sandbox.interrupt()
        return len(hung_up)

    def reap(self, now: float | None = None) -> list[str]:
        """Close sandboxes whose lease lapsed (unless busy) or whose wall time ran out."""
        self.interrupt_abandoned()
        now = now or time.time()
        doomed: list[tuple[str, str]] = []
        with self._lock:
            for slot in self._slots.values():
                if slot.wall_deadline and now >= slot.wall_deadline:
                    doomed.append((slot.sandbox_id, "wall time limit"))
                elif slot.busy or (slot.keeper is not None and slot.keeper in self._slots):
                    slot.renew()  # a long command keeps its own lease alive; a sidecar, its keeper's
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


def start_concurrency() -> int:
    from config.settings import get_settings

    return get_settings().sandbox_start_concurrency or 16 * (os.cpu_count() or 1)


def limit_enforcement() -> dict[str, str]:
    """Limit name -> how this node enforces it (:func:`sandboxes.runtimes.limits.cgroups.enforcement`,
    imported lazily: it probes the node); empty when the probe fails."""
    from sandboxes.runtimes.limits.cgroups import enforcement

    try:
        return dict(enforcement())
    except Exception as exc:  # noqa: BLE001 - reported, not raised: a probe must not stop creates
        log.warning("could not tell how limits are enforced: %s", exc)
        return {}


def _usage_of(sandbox: Sandbox) -> dict[str, Any] | None:
    """The runtime's usage reading (a runtime class without the hook: None, not measured)."""
    hook = getattr(sandbox, "usage", None)
    try:
        return hook() if hook is not None else None
    except Exception:  # noqa: BLE001 - a reading never stops a close
        log.warning("could not read a sandbox's usage", exc_info=True)
        return None


def _close(sandbox: Sandbox, sandbox_id: str) -> None:
    try:
        sandbox.close()
    except Exception:
        log.exception("closing sandbox %s failed", sandbox_id)
