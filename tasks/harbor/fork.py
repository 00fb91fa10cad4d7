"""Init once, fork n: the jobs of one group on one Harbor task prepare its first step once and
start from that prepared root.

The first job of a group to reach init takes the group's lock (Redis, with a TTL its holder
renews: a preparer that dies lets it lapse, and the next waiter takes over), opens a sandbox of
the image, starts the image's ENTRYPOINT, puts the step's ``workdir/`` in and runs its
``setup.sh``, then has the host kill everything in it and freeze its root's changes into a
read-only layer (:mod:`sandboxes.runtimes.layers`), which it publishes. Every job of the group,
the preparer included, then opens its own sandbox with that layer under its overlay
(``spec.layers``): copy-on-write, so a sample sees the prepared files, never another sample's
writes, and never changes the layer. The others wait meanwhile (bounded by their init budget,
cancellable); the wait is not charged, and shows in ``timings.init_wait`` and the result's
``harbor.fork.waited_s``.

What carries over is files: processes do not. The ENTRYPOINT, the solution's files and the
healthcheck still run in each sample's sandbox; a daemon ``setup.sh`` started is gone in the
forks (its files, a database's data directory, remain): a task whose setup starts a service its
agent needs should start it from its ENTRYPOINT, or turn forking off.

A layer is keyed by the group, the image, the step and its ``workdir/`` content, and the sandbox's
env, working directory and network; the beat sweep removes it once every job of its group ended,
or after ``harbor_fork_ttl_s`` (:mod:`tasks.sweep.layers`). Off: ``PRORL_HARBOR_FORK=0``, or an
instance's ``"fork": false``; a job outside a group, a group of one, and a step with no
``workdir/`` prepare their own as before, and the result says why.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.errors import StageBudgetExceeded
from prorl_celery.leases import RELEASE_HELD, RENEW_HELD
from sandboxes.base import SandboxSpec
from tasks.context import StageContext
from tasks.harbor.task import HarborTask

LOCK_TTL_S = 30.0
POLL_S = 0.2


def why_not(ctx: StageContext, task: HarborTask, step: int) -> str | None:
    """Why this job prepares its own sandbox (None: it forks from its group's)."""
    if not get_settings().harbor_fork:
        return "off (PRORL_HARBOR_FORK=0)"
    if ctx.instance.get("fork") is False:
        return "off (instance.fork)"
    if not ctx.record.group_id:
        return "not in a group"
    if task.steps[step].workdir_files is None:
        return "nothing to prepare (no workdir/)"
    if task.compose:  # its setup may talk to its services, which a preparing sandbox has not
        return "sidecar services (docker-compose.yaml)"
    if len(ctx.store.group_ids(ctx.record.group_id)) < 2:
        return "a group of one"
    return None


def content_key(image_key: str, step: int, workdir: Path, spec: SandboxSpec) -> str:
    """What the prepared root is made of: the image, the step, its files and the sandbox's
    env, working directory and network."""
    digest = hashlib.sha256(json.dumps({"image": image_key, "step": step, "env": spec.env,
                                        "workdir": spec.workdir, "network": spec.network},
                                       sort_keys=True).encode())
    for top, dirs, names in sorted(os.walk(workdir)):
        dirs.sort()
        for name in sorted(names):
            path = Path(top) / name
            st = path.lstat()
            digest.update(f"\0{path.relative_to(workdir)}\0{st.st_mode:o}\0".encode())
            digest.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
    return digest.hexdigest()


def layer_name(group_id: str, content: str, step: int) -> str:
    """The layer's name: the group and the content, hashed (a group id is anyone's text)."""
    return f"g{hashlib.sha256(group_id.encode()).hexdigest()[:16]}-{content[:24]}-s{step}"


class Gate(Protocol):
    """Where the jobs of a group meet: the published layer, and the lock of its preparer."""

    def ready(self) -> dict[str, Any] | None: ...
    def hold(self) -> bool: ...
    def keep(self) -> bool: ...
    def publish(self, record: dict[str, Any]) -> None: ...
    def let_go(self) -> None: ...


class RedisGate:
    """:class:`Gate` in Redis: the record ``keys.fork_layer`` (kept ``harbor_fork_ttl_s``) and the
    lock ``keys.fork_lock`` (a token, set if absent, with a TTL its holder renews)."""

    def __init__(self, client, name: str, ttl_s: float, lock_ttl_s: float = LOCK_TTL_S):
        self.redis, self.ttl_s, self.lock_ttl_ms = client, ttl_s, int(lock_ttl_s * 1000)
        self.record_key, self.lock_key = keys.fork_layer(name), keys.fork_lock(name)
        self.token = secrets.token_hex(16)

    def ready(self) -> dict[str, Any] | None:
        raw = self.redis.get(self.record_key)
        return json.loads(raw) if raw else None

    def hold(self) -> bool:
        return bool(self.redis.set(self.lock_key, self.token, nx=True, px=self.lock_ttl_ms))

    def keep(self) -> bool:
        return bool(RENEW_HELD(self.redis, [self.lock_key], [self.token, self.lock_ttl_ms]))

    def publish(self, record: dict[str, Any]) -> None:
        self.redis.set(self.record_key, json.dumps(record), ex=max(1, int(self.ttl_s)))

    def let_go(self) -> None:
        RELEASE_HELD(self.redis, [self.lock_key], [self.token])


class _Kept:
    """The gate's lock renewed every third of its TTL while the block runs."""

    def __init__(self, gate: Gate, every_s: float):
        self.gate, self.every_s, self.stop = gate, every_s, threading.Event()
        self.thread = threading.Thread(target=self._renew, name="harbor-fork-lock", daemon=True)

    def _renew(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                if not self.gate.keep():
                    return  # lost: a second preparer may start; the host keeps the first layer frozen
            except Exception:  # noqa: BLE001 - Redis away: the lock lapses, as a dead preparer's
                return

    def __enter__(self) -> None:
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        self.stop.set()


def wait_or_prepare(gate: Gate, prepare: Callable[[], dict[str, Any]], check: Callable[[], None],
                    poll_s: float = POLL_S, renew_s: float = LOCK_TTL_S / 3) -> tuple[dict[str, Any], bool, float]:
    """The group's published record, made by ``prepare`` under the gate's lock if no one has
    (a lock that lapses, its holder dead, is taken by the next waiter); returns (record, whether
    this call prepared it, seconds waited for another's). ``check`` raises to stop waiting."""
    started = time.monotonic()
    while True:
        record = gate.ready()
        if record is not None:
            return record, False, time.monotonic() - started
        if gate.hold():
            waited = time.monotonic() - started
            try:
                record = gate.ready()  # published between the look and the lock
                if record is not None:
                    return record, False, waited
                with _Kept(gate, renew_s):
                    record = prepare()
                gate.publish(record)
                return record, True, waited
            finally:
                gate.let_go()
        check()
        time.sleep(poll_s)


def prepared(ctx: StageContext, task: HarborTask, step: int, image: dict[str, Any], spec: SandboxSpec,
             setup: Callable[[Any], None]) -> dict[str, Any]:
    """The group's layer for ``step``, prepared here (``setup`` on a sandbox of ``spec``, then
    frozen) or by another job of the group; the result's ``fork`` block: ``{from, layer,
    waited_s, prepare_s, freeze_s, files, bytes}``, or ``{off: why}`` when this job prepares its own."""
    why = why_not(ctx, task, step)
    if why:
        return {"off": why}
    workdir, budget = task.steps[step].workdir_files, ctx.remaining()
    name = layer_name(ctx.record.group_id, content_key(image["key"], step, workdir, spec), step)

    def prepare() -> dict[str, Any]:
        started = time.monotonic()
        ctx.deadline = time.monotonic() + budget  # the preparer's setup is its own: charged from here
        box = ctx.open_sandbox(spec)  # the job's own until frozen (the freeze closes it)
        setup(box)
        frozen = time.monotonic()
        entry = box.freeze(name, group_id=ctx.record.group_id, job_id=ctx.job_id,
                           timeout=max(10.0, min(600.0, ctx.remaining())))
        now = time.monotonic()
        return {"job_id": ctx.job_id, "layer": name, "prepare_s": round(now - started, 3),
                "freeze_s": round(now - frozen, 3), "files": entry.files, "bytes": entry.bytes}

    gate, before = RedisGate(ctx.store.redis, name, get_settings().harbor_fork_ttl_s), ctx.deadline
    record, mine, waited = wait_or_prepare(gate, prepare, _uncharged(ctx))
    if not mine:
        ctx.deadline = before + waited  # the whole wait, not charged
    ctx.state.init_wait_s = round((ctx.state.init_wait_s or 0.0) + waited, 3)
    return {"from": "self" if mine else record["job_id"], "layer": name, "waited_s": round(waited, 3),
            **{k: record.get(k) for k in ("prepare_s", "freeze_s", "files", "bytes")}}


def _uncharged(ctx: StageContext) -> Callable[[], None]:
    """The wait's check: the job cancelled or ended raises; the time waited is added to the
    stage's deadline (another job's setup is waited out, not charged), up to the stage's whole
    budget once more (a preparer alive but stuck)."""
    started, deadline, budget = time.monotonic(), ctx.deadline, ctx.remaining()

    def check() -> None:
        waited = time.monotonic() - started
        if waited > budget:
            raise StageBudgetExceeded(f"waited {waited:.0f} s for the group's setup (tasks/harbor/fork.py): "
                                      "longer than the init stage's budget")
        ctx.deadline = deadline + waited
        ctx.check()

    return check


def on_layer(spec: SandboxSpec, fork: dict[str, Any]) -> SandboxSpec:
    """``spec`` started on the group's layer, where there is one."""
    return spec.model_copy(update={"layers": [fork["layer"]]}) if fork.get("layer") else spec
