"""The CPU weight of dying sandboxes (sandboxes/runtimes/limits/exitboost.py), on the node's real cgroup
v1 cpu hierarchy and real processes: raised for the killed ones only after the kills, lowered as
they exit (pidfds), set back when the last is gone or when the boost is too old."""
from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import pytest

from sandboxes.base import SandboxSpec
from sandboxes.host.pool import SandboxPool
from sandboxes.runtimes.limits import cgroups
from sandboxes.runtimes.limits import exitboost
from sandboxes.runtimes.limits.exitboost import BASE_SHARES, MAX_SHARES, ExitBoost, level
from tests.conftest import wait_until
from tests.sandboxes.conftest import needs_bwrap, sandbox_root  # noqa: F401

pytestmark = pytest.mark.skipif(not cgroups.controllers(), reason=cgroups.why_not() or "no cgroups")


def _shares(directory: Path) -> int:
    return int((directory / "cpu.shares").read_text())


@pytest.fixture
def tree():
    """A cpu cgroup of the test's own with two children (as ``prorl`` and two sandboxes)."""
    parent = cgroups.V1_ROOT / "cpu" / f"prorl-test-{secrets.token_hex(4)}"
    children = [parent / "a", parent / "b"]
    for child in children:
        child.mkdir(parents=True)
    yield parent, children
    for directory in (*children, parent):
        directory.rmdir()


def _pidfds() -> int:
    """Pidfds this process holds (a closed descriptor's number may be reused at once: count them)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        except OSError:
            pass
    return count


def _sleeper() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(["sleep", "60"])
    return proc, os.pidfd_open(proc.pid)


def test_the_weight_rises_after_the_kills_falls_as_they_exit_and_is_set_back(tree):
    parent, (a, b) = tree
    boost = ExitBoost(parent)
    before = _pidfds()
    procs = [_sleeper() for _ in range(3)]
    for directory, (_, pidfd) in zip((a, b, b), procs):
        boost.add(directory, pidfd)
    assert _shares(a) == _shares(b) == MAX_SHARES  # the doomed first, among the sandboxes
    assert _shares(parent) == BASE_SHARES  # nothing raised before the kills are done
    boost.commit()
    assert _shares(parent) == level(3) == 4 * BASE_SHARES
    try:
        procs[0][0].kill()
        procs[0][0].wait()
        wait_until(lambda: _shares(parent) == level(2), 5, "the weight of two dying")
        for proc, _ in procs[1:]:
            proc.kill()
            proc.wait()
        wait_until(lambda: _shares(parent) == BASE_SHARES and boost.dying == 0, 5, "the weight set back")
    finally:
        for proc, _ in procs:
            proc.kill()
            proc.wait()
    assert _pidfds() == before  # the boost closed every pidfd it was given


def test_a_process_that_never_exits_does_not_hold_the_weight(tree, monkeypatch):
    parent, (a, _) = tree
    monkeypatch.setattr(exitboost, "LONGEST_S", 0.3)
    boost = ExitBoost(parent)
    proc, pidfd = _sleeper()
    try:
        boost.add(a, pidfd)
        boost.commit()
        assert _shares(parent) == level(1)
        wait_until(lambda: _shares(parent) == BASE_SHARES, 5, "the boost to expire")
        assert proc.poll() is None and boost.dying == 0
    finally:
        proc.kill()
        proc.wait()


def test_the_weight_is_capped_at_what_the_kernel_takes():
    assert level(10_000) == MAX_SHARES and level(0) == BASE_SHARES


@needs_bwrap()
def test_a_bulk_close_of_bwrap_sandboxes_boosts_them_until_they_are_gone(sandbox_root, monkeypatch):
    """Through the host's pool: every sandbox's own weight is raised before any kill, ``prorl``'s
    once all are killed, and it is back at 1024 when they are gone."""
    writes: list[tuple[str, int, int]] = []
    real_write = exitboost._write
    killed: list[str] = []

    def recording(path: Path, value: int) -> bool:
        writes.append((str(path), value, len(killed)))
        return real_write(path, value)

    monkeypatch.setattr(exitboost, "_write", recording)
    monkeypatch.setattr(exitboost, "_boost", ExitBoost(exitboost.parent()))
    pool = SandboxPool("boost-test", 8, 60, runtime_config={"bwrap": {"root": str(sandbox_root)}})
    ids = [pool.create(f"j{i}", SandboxSpec(runtime="bwrap")).sandbox_id for i in range(4)]
    for sandbox_id in ids:
        sandbox = pool._slots[sandbox_id].sandbox
        original = sandbox.kill
        sandbox.kill = lambda original=original, sid=sandbox_id: (killed.append(sid), original())
    parent = str(exitboost.parent() / "cpu.shares")
    assert sorted(pool.close_many(ids)) == sorted(ids)
    favours = [(value, kills) for path, value, kills in writes if path != parent]
    assert favours == [(MAX_SHARES, 0)] * 4  # each sandbox's own weight, before any kill
    raised = [(value, kills) for path, value, kills in writes if path == parent]
    assert raised[0] == (level(4), 4)  # prorl's once every sandbox of the call was killed
    wait_until(lambda: exitboost._boost.dying == 0, 10, "the sandboxes to be gone")
    assert _shares(exitboost.parent()) == BASE_SHARES
    pool.drain()


def test_a_starting_host_sets_a_leftover_boost_back():
    path = exitboost.parent() / "cpu.shares"
    path.parent.mkdir(exist_ok=True)
    path.write_text(str(level(50)))  # as a host killed mid-boost leaves it
    exitboost.reset()
    assert _shares(exitboost.parent()) == BASE_SHARES
