"""No sandbox outlives its host, however the host dies (issue 13 item 5).

Each case starts a real sandbox host (its own session, as a batch system or systemd starts it)
with real bwrap sandboxes (workspace filesystems on loop devices, cgroups, some with slirp4netns),
kills it one way, counts what is left, starts a second host on the same root and counts again:
processes by cgroup membership, by the sandboxes' uid range and by the first host's descendants
(recorded before the kill); mounts, loop devices, cgroups and workspaces of the first host.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from sandboxes.runtimes.limits import cgroups
from sandboxes.host.reap import kill_naming, kill_unleased_uids, loops_under, mounts_under, UidRange
from tests.sandboxes.conftest import REPO, needs_bwrap, wait_until

pytestmark = [needs_bwrap(), pytest.mark.skipif(os.geteuid() != 0, reason="uids, cgroups and "
                                                "workspace filesystems need a root host")]
UID_COUNT = 64


class Node:
    """One workspace root, one private uid range and lock directory, hosts started on it."""

    def __init__(self, root: Path):
        self.root = root
        self.uid_base = 3_100_000 + random.randrange(1000) * UID_COUNT
        self.lock_dir = tempfile.mkdtemp(prefix="prorl-test-uids-")
        self.hosts: list[subprocess.Popen] = []

    def runtime_config(self) -> dict:
        return {"bwrap": {"root": str(self.root), "uid_base": self.uid_base, "uid_count": UID_COUNT,
                          "uid_lock_dir": self.lock_dir}}

    def start_host(self, host_id: str) -> tuple[subprocess.Popen, str, str]:
        ready = self.root.parent / f"{self.root.name}-{host_id}.json"
        argv = [sys.executable, "-m", "sandboxes.host.main", "--no-register", "--host-id", host_id,
                "--ready-file", str(ready), "--runtimes", "bwrap", "--warm", "0", "--capacity", "64",
                "--log-level", "WARNING", "--runtime-config", json.dumps(self.runtime_config())]
        proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdout=subprocess.DEVNULL, start_new_session=True)
        self.hosts.append(proc)
        assert wait_until(ready.exists, 30), "sandbox host did not start"
        info = json.loads(ready.read_text())
        ready.unlink()
        return proc, info["address"], info["token"]

    def uid_processes(self) -> list[int]:
        return [p.pid for p in psutil.process_iter(["uids"])
                if p.info["uids"] and self.uid_base <= p.info["uids"].real < self.uid_base + UID_COUNT]

    def cgroup_members(self, host_id: str) -> int:
        base = cgroups.V1_ROOT / "pids" / cgroups.PREFIX / cgroups.host_key(str(self.root / host_id))
        return sum(len((d / "cgroup.procs").read_text().split()) for d in base.glob("*/")) if base.is_dir() else 0

    def cgroup_dirs(self, host_id: str) -> int:
        base = cgroups.V1_ROOT / "pids" / cgroups.PREFIX / cgroups.host_key(str(self.root / host_id))
        return len(list(base.glob("*/"))) if base.is_dir() else 0

    def stop(self) -> None:
        for proc in self.hosts:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


@pytest.fixture
def node(sandbox_root):
    made = Node(sandbox_root)
    yield made
    made.stop()


def _create(address: str, token: str, i: int) -> str | None:
    from sandboxes.runtimes.limits.netns import refusal

    headers = {"Authorization": f"Bearer {token}"}
    spec = {"runtime": "bwrap", "network": i % 2 == 0 and refusal() is None}
    try:
        reply = requests.post(f"{address}/sandboxes", headers=headers, json={"job_id": f"j{i}", "spec": spec},
                              timeout=60)
        sandbox_id = reply.json()["sandbox_id"]
        requests.post(f"{address}/sandboxes/{sandbox_id}/exec", headers=headers, timeout=60,
                      json={"command": "(setsid sleep 1000 &); sleep 999 & echo up", "timeout": 20})
        return sandbox_id
    except (requests.RequestException, KeyError, ValueError):
        return None  # the burst case kills the host while creations are in flight


def _kill(proc: psutil.Process, mode: str) -> None:
    if mode == "host":
        proc.kill()
    elif mode == "group":  # kill -- -PGID (scancel, systemctl stop: the whole group at once)
        os.killpg(proc.pid, signal.SIGKILL)
    elif mode == "term_then_kill":  # an operator's stop: SIGTERM to the group, SIGKILL 3 s later
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(3)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    elif mode == "guardian_first":
        for child in proc.children(recursive=True):
            if "sandboxes.runtimes.shell.guardian" in " ".join(child.cmdline()):
                child.kill()
        time.sleep(0.3)
        proc.kill()


@pytest.mark.parametrize("mode", ["host", "group", "term_then_kill", "guardian_first", "burst"])
def test_no_sandbox_outlives_its_host(node, mode):
    first, address, token = node.start_host("reap-a")
    host = psutil.Process(first.pid)
    if mode == "burst":  # SIGKILL in the middle of a burst of creations, as the OOM killer does
        threads = [threading.Thread(target=_create, args=(address, token, i), daemon=True) for i in range(24)]
        for thread in threads:
            thread.start()
        assert wait_until(lambda: len(node.uid_processes()) >= 6, 30)  # some run, others start
    else:
        assert all(_create(address, token, i) for i in range(3))
    descendants = [p.pid for p in host.children(recursive=True)]
    # (workspace filesystems: loop devices of the node; their mounts may live in the host's own
    # mount namespace, sandboxes/runtimes/limits/mountns.py, which dies with it)
    assert node.uid_processes() and node.cgroup_members("reap-a") and loops_under(node.root / "reap-a")
    if mode == "burst":
        os.killpg(first.pid, signal.SIGKILL)
    else:
        _kill(host, mode)
    first.wait(timeout=30)

    # right after the host's death: no process of its sandboxes is left, however it died
    assert wait_until(lambda: not node.uid_processes() and not node.cgroup_members("reap-a"), 10), \
        (mode, node.uid_processes())
    assert wait_until(lambda: not [pid for pid in descendants if psutil.pid_exists(pid)
                                   and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], 10)

    # a host starting on the node reaps the rest: mounts, loop devices, cgroups, workspaces
    node.start_host("reap-b")
    assert mounts_under(node.root / "reap-a") == []
    assert wait_until(lambda: loops_under(node.root / "reap-a") == [], 5)
    assert node.cgroup_dirs("reap-a") == 0
    assert not (node.root / "reap-a").exists() and not (node.root / ".reap-a.lock").exists()
    assert node.uid_processes() == []


def test_reaper_kills_processes_of_unleased_uids_and_of_dead_hosts_dirs(node):
    """The two finders for what bwrap's die-with-parent misses (a sandbox whose start was between
    the host's fork and bwrap's prctl when the host died), on real processes: one running as a
    sandbox uid nobody leases, one whose command line names a dead host's workspace; a process
    of a leased uid is left alone."""
    from sandboxes.runtimes.limits.uids import lease_uid

    uid = node.uid_base + 3
    orphan = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "1000"],
                              start_new_session=True)
    held = lease_uid(node.uid_base + 5, 1, node.lock_dir)
    kept = subprocess.Popen(["setpriv", f"--reuid={held.uid}", f"--regid={held.uid}", "--clear-groups",
                             "sleep", "1000"], start_new_session=True)
    dead_dir = node.root / "dead-host" / "bwrap-x"
    named = subprocess.Popen(["sh", "-c", "sleep 1000", str(dead_dir)], start_new_session=True)
    try:
        assert wait_until(lambda: len(node.uid_processes()) == 2, 5)
        ranges = [UidRange(node.uid_base, UID_COUNT, node.lock_dir)]
        assert kill_unleased_uids(ranges) >= 1
        assert orphan.wait(timeout=5) == -signal.SIGKILL and kept.poll() is None
        assert kill_naming(node.root / "dead-host") >= 1
        assert named.wait(timeout=5) == -signal.SIGKILL
        assert kill_naming(node.root / "other-host") == 0
    finally:
        for proc in (orphan, kept, named):
            proc.kill()
            proc.wait()
        held.release()
