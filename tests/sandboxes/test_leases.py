"""Nothing a sandbox started outlives its lease, its worker, or its host."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sandboxes.runtimes.procs import alive
from tests.sandboxes.conftest import REPO, needs_bwrap, wait_until
from tests.sandboxes.test_host import create, entry_of

pytestmark = needs_bwrap()

# Leaves a process that left the shell's session and process group, the kind a pattern-based
# cleanup misses.
DAEMONIZE = "setsid sleep 1000 </dev/null >/dev/null 2>&1 & (sleep 1001 &) ; echo started"


def processes_of_uid(uid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as fh:
                    status = fh.read()
            except OSError:
                continue
            if f"\nUid:\t{uid}\t" in status and alive(int(name)):
                found.append(int(name))
    return found


def sandbox_gone(info: dict) -> bool:
    """No process of the sandbox (all run as its own uid) and no workspace left."""
    return (not any(alive(info[key]) for key in ("pid", "init_pid", "shell_pid"))
            and not processes_of_uid(info["uid"]) and not os.path.exists(info["workspace"]))


@pytest.fixture(autouse=True)
def _root_only():
    if os.geteuid() != 0:
        pytest.skip("tracks sandbox processes by their own uid, which only a root host assigns")


def test_lapsed_lease_removes_the_whole_tree_within_one_sweep_period(start_host):
    host = start_host(runtime="bwrap")
    box = create(host, lease_s=1)
    assert box.exec(DAEMONIZE).output == "started\n"
    info = entry_of(host, box).info
    assert len(processes_of_uid(info["uid"])) >= 5  # bwrap, bwrap, bash, two sleeps
    started = time.monotonic()
    assert wait_until(lambda: sandbox_gone(info), timeout=4)
    assert time.monotonic() - started < 1 + 1 + 1  # lease + one reaper period + teardown


WORKER = """
import json, sys
from sandboxes.base import SandboxSpec
from sandboxes.client import open_sandbox
import redis
box = open_sandbox(redis.Redis.from_url(sys.argv[1]), SandboxSpec(runtime="bwrap"), "job-w", lease_s=1)
box.exec({daemonize!r})
print(json.dumps(box.info()), flush=True)
box.exec("sleep 600", timeout=900)  # killed while this runs
"""


def test_killing_a_worker_mid_command_leaves_nothing_after_the_lease(start_host, sandbox_redis):
    start_host(runtime="bwrap")
    worker = subprocess.Popen([sys.executable, "-c", WORKER.format(daemonize=DAEMONIZE), sandbox_redis],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdout=subprocess.PIPE, text=True)
    info = json.loads(worker.stdout.readline())
    time.sleep(0.3)  # the sleep 600 is running now
    assert processes_of_uid(info["uid"])
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    # the host sees the caller hang up, interrupts the command, then the 1 s lease lapses
    assert wait_until(lambda: sandbox_gone(info), timeout=5)


def test_killing_the_host_kills_its_sandboxes_and_a_restart_wipes_their_files(start_host, sandbox_root):
    host = start_host(runtime="bwrap")
    infos = []
    for job in ("job-1", "job-2"):
        box = create(host, job)
        box.exec(DAEMONIZE)
        box.write_file("left-behind.txt", b"x")
        infos.append(entry_of(host, box).info)
    host.stop(signal.SIGKILL)
    assert wait_until(lambda: not any(processes_of_uid(i["uid"]) for i in infos), timeout=5)
    assert all(os.path.exists(i["workspace"]) for i in infos)  # kill -9: nobody removed them
    again = start_host(runtime="bwrap", host_id=host.host_id)
    assert not any(os.path.exists(i["workspace"]) for i in infos)
    assert create(again, "job-3").exec("echo fresh").output == "fresh\n"
    # one workspace (and, where the host is root, its filesystem image ".<name>.img" beside it)
    assert len([n for n in os.listdir(sandbox_root / host.host_id) if not n.startswith(".")]) == 1


def test_a_second_host_cannot_take_a_live_host_id(start_host):
    host = start_host(runtime="bwrap")
    box = create(host)
    with pytest.raises(AssertionError):  # it exits instead of wiping the live host's sandboxes
        start_host(runtime="bwrap", host_id=host.host_id)
    assert box.exec("echo unharmed").output == "unharmed\n"
