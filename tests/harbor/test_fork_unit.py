"""Init once, fork n, in process: how a group's layer is keyed, how the jobs of a group meet at
its gate (one prepares, the others wait; a dead preparer's lock lapses and a waiter takes over;
a cancelled or out-of-budget wait ends), and which layers the sweep removes."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from prorl_celery.errors import JobCancelled
from prorl_celery.status import JobStatus
from sandboxes.base import SandboxSpec
from sandboxes.protocol import LayerEntry
from tasks.harbor.fork import content_key, layer_name, wait_or_prepare, why_not
from tasks.sweep.layers import layer_doomed

pytestmark = pytest.mark.unit
SPEC = SandboxSpec(image="/img", writable_root=True, workdir="/app", env={"A": "1"})


class MemoryGate:
    """The :class:`~tasks.harbor.fork.Gate` of the jobs of one group, in memory: a lock whose
    TTL lapses unless its holder keeps it."""

    def __init__(self, shared: dict, ttl_s: float = 0.3):
        self.shared, self.ttl_s, self.me = shared, ttl_s, object()
        shared.setdefault("mutex", threading.Lock())

    def ready(self):
        return self.shared.get("record")

    def hold(self) -> bool:
        with self.shared["mutex"]:
            holder, until = self.shared.get("lock", (None, 0.0))
            if holder is not None and until > time.monotonic():
                return False
            self.shared["lock"] = (self.me, time.monotonic() + self.ttl_s)
            return True

    def keep(self) -> bool:
        with self.shared["mutex"]:
            if self.shared.get("lock", (None,))[0] is not self.me:
                return False
            self.shared["lock"] = (self.me, time.monotonic() + self.ttl_s)
            return True

    def publish(self, record) -> None:
        self.shared["record"] = record

    def let_go(self) -> None:
        with self.shared["mutex"]:
            if self.shared.get("lock", (None,))[0] is self.me:
                self.shared.pop("lock")


def never() -> None:
    pass


def test_one_job_of_a_group_prepares_and_the_others_wait_for_its_layer():
    shared, made = {}, []

    def prepare():
        made.append(1)
        time.sleep(0.3)
        return {"job_id": "j1", "layer": "L"}

    results = []
    threads = [threading.Thread(target=lambda: results.append(
        wait_or_prepare(MemoryGate(shared), prepare, never, poll_s=0.01, renew_s=0.05))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert made == [1] and len(results) == 4
    assert sorted(mine for _, mine, _ in results) == [False, False, False, True]
    assert all(record == {"job_id": "j1", "layer": "L"} for record, _, _ in results)
    assert max(waited for _, mine, waited in results if not mine) >= 0.2  # waited out the preparer
    assert "lock" not in shared


def test_a_dead_preparers_lock_lapses_and_a_waiter_takes_over():
    shared = {}
    dead = MemoryGate(shared, ttl_s=0.2)
    assert dead.hold()  # and never keeps it, never publishes: its worker was killed
    record, mine, waited = wait_or_prepare(MemoryGate(shared), lambda: {"job_id": "j2"}, never, poll_s=0.01)
    assert mine and record == {"job_id": "j2"} and waited >= 0.15


def test_a_preparer_that_fails_lets_go_and_a_wait_ends_when_its_job_does():
    shared = {}

    def broken():
        raise RuntimeError("setup.sh failed")

    with pytest.raises(RuntimeError):
        wait_or_prepare(MemoryGate(shared), broken, never)
    assert "lock" not in shared and "record" not in shared  # the next job may try
    MemoryGate(shared, ttl_s=60).hold()  # a live preparer, slow

    def cancelled():
        raise JobCancelled("cancelled while waiting")

    with pytest.raises(JobCancelled):
        wait_or_prepare(MemoryGate(shared), lambda: {}, cancelled, poll_s=0.01)


def test_a_long_preparation_keeps_its_lock():
    shared = {}

    def slow():
        time.sleep(0.5)  # longer than the lock's TTL: kept alive meanwhile
        return {"job_id": "j1"}

    holder = threading.Thread(target=wait_or_prepare, args=(MemoryGate(shared, ttl_s=0.2), slow, never),
                              kwargs={"renew_s": 0.05})
    holder.start()
    time.sleep(0.05)
    prepared_twice = []
    record, mine, _ = wait_or_prepare(MemoryGate(shared), lambda: prepared_twice.append(1) or {}, never, poll_s=0.01)
    holder.join(5)
    assert not mine and record == {"job_id": "j1"} and prepared_twice == []


def test_a_layer_is_keyed_by_group_image_step_files_and_sandbox(tmp_path: Path):
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    (workdir / "setup.sh").write_text("git init\n")
    key = content_key("img-1", 0, workdir, SPEC)
    assert key == content_key("img-1", 0, workdir, SPEC)
    assert layer_name("group-a", key, 0) == layer_name("group-a", key, 0)
    assert layer_name("group-a", key, 0) != layer_name("group-b", key, 0)
    others = {content_key("img-2", 0, workdir, SPEC), content_key("img-1", 1, workdir, SPEC),
              content_key("img-1", 0, workdir, SPEC.model_copy(update={"env": {"A": "2"}})),
              content_key("img-1", 0, workdir, SPEC.model_copy(update={"network": True}))}
    (workdir / "setup.sh").write_text("git init -q\n")
    others.add(content_key("img-1", 0, workdir, SPEC))
    assert key not in others and len(others) == 5
    name = layer_name("any text / ../ at all", key, 3)
    assert SandboxSpec(image="/img", writable_root=True, layers=[name]).layers == [name]


def _ctx(group_id: str | None, members: int, instance: dict | None = None):
    store = SimpleNamespace(group_ids=lambda group: [f"j{i}" for i in range(members)])
    return SimpleNamespace(instance=instance or {}, record=SimpleNamespace(group_id=group_id), store=store)


def test_who_forks(tmp_path: Path, monkeypatch):
    with_files = SimpleNamespace(steps=[SimpleNamespace(workdir_files=tmp_path)], compose=None)
    without = SimpleNamespace(steps=[SimpleNamespace(workdir_files=None)], compose=None)
    with_services = SimpleNamespace(steps=with_files.steps, compose=object())
    assert why_not(_ctx("g", 8), with_files, 0) is None
    assert why_not(_ctx("g", 8), with_services, 0) == "sidecar services (docker-compose.yaml)"
    assert why_not(_ctx(None, 0), with_files, 0) == "not in a group"
    assert why_not(_ctx("g", 1), with_files, 0) == "a group of one"
    assert why_not(_ctx("g", 8), without, 0) == "nothing to prepare (no workdir/)"
    assert why_not(_ctx("g", 8, {"fork": False}), with_files, 0) == "off (instance.fork)"
    monkeypatch.setenv("PRORL_HARBOR_FORK", "0")
    from config.settings import get_settings

    get_settings.cache_clear()
    try:
        assert why_not(_ctx("g", 8), with_files, 0) == "off (PRORL_HARBOR_FORK=0)"
    finally:
        monkeypatch.delenv("PRORL_HARBOR_FORK")
        get_settings.cache_clear()


def test_the_sweep_removes_a_layer_once_its_group_ended_or_its_ttl_passed():
    now = 10_000.0
    layer = LayerEntry(name="g1-abc-s0", created_at=now - 60, group_id="g1")
    running = [JobStatus.COMPLETED, JobStatus.RUN]
    assert layer_doomed(layer, running, now, 3600) is None
    assert layer_doomed(layer, [JobStatus.COMPLETED, JobStatus.FAILED, None], now, 3600) == "its group ended"
    assert layer_doomed(layer, [], now, 3600) == "its group is unknown"
    assert "older than" in layer_doomed(layer, running, now, 30)
    assert layer_doomed(layer.model_copy(update={"in_use": True}), [JobStatus.COMPLETED], now, 30) is None


def test_a_request_cannot_name_layers():
    from prorl_celery.errors import PolicyDenied
    from sandboxes.policy import check_request_sandbox

    with pytest.raises(PolicyDenied) as caught:
        check_request_sandbox({"image": None, "layers": ["gabcdef0123456789-abc-s0"]})
    assert caught.value.field == "instance.sandbox.layers"


def test_waiting_for_the_groups_setup_is_not_charged_but_is_bounded():
    from prorl_celery.errors import StageBudgetExceeded
    from tasks.harbor.fork import _uncharged

    ctx = SimpleNamespace(deadline=time.monotonic() + 0.2, checks=0)
    ctx.remaining = lambda: ctx.deadline - time.monotonic()
    ctx.check = lambda: setattr(ctx, "checks", ctx.checks + 1)
    check = _uncharged(ctx)
    before = ctx.deadline
    time.sleep(0.1)
    check()
    assert ctx.deadline >= before + 0.1 and ctx.checks == 1  # the wait moved the deadline
    time.sleep(0.15)
    with pytest.raises(StageBudgetExceeded):  # waited longer than a whole budget: a stuck preparer
        check()
