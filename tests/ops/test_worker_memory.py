"""The run worker's memory under a cgroup of its own (issue 32 item 3; tasks/worker_memory.py):
each run worker process is placed in a memory cgroup with the operator's limit, nested in the
group it was started in, removed when it exits; over the limit the kernel kills the process (a
killed run worker's stages come back through the lost-worker path: tests/chaos)."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxes.runtimes.limits import owncg
from tasks.worker_memory import PREFIX
from tests.conftest import TEST_ENV, wait_until

pytestmark = pytest.mark.skipif(bool(owncg.why_not()), reason=f"no memory cgroup here: {owncg.why_not()}")


def _group_of(pid: int) -> Path | None:
    group = owncg.current_memory_cgroup(pid)
    return group if group is not None and group.name == f"{PREFIX}-{pid}" else None


def test_each_run_worker_process_is_held_by_its_own_memory_cgroup(redis_url, tmp_path):
    from prorl_celery.ops.launcher import Stack, StackOptions

    stack = Stack(StackOptions(state_dir=tmp_path, redis_url=redis_url, beat=False,
                               concurrency={"run": 2, "eval": 1},
                               env={**TEST_ENV, "PRORL_RUN_WORKER_MEMORY_MB": "300"}))
    try:
        runs = [stack.start_worker("run", name, 1) for name in ("worker-run", "worker-run-2")]
        evaluator = stack.start_worker("eval")
        pids = [child.popen.pid for child in runs]
        wait_until(lambda: all(_group_of(pid) for pid in pids), 60, "the run workers to enter their groups")
        for pid in pids:
            group = _group_of(pid)
            assert group.parent == owncg.current_memory_cgroup()  # nested where it was started
            assert int((group / "memory.limit_in_bytes").read_text()) == 300 << 20
            assert pid in owncg.pids_in(group)
        assert _group_of(evaluator.popen.pid) is None  # the limit is the run worker's
        groups = [_group_of(pid) for pid in pids]
        log = tmp_path / "logs" / "worker-run.log"  # (a SIGTERM before celery's handlers kills outright)
        wait_until(lambda: "memory limited to 300 MiB" in log.read_text(), 60, "the run worker to be ready")
        runs[0].signal(signal.SIGTERM)
        runs[0].popen.wait(30)
        assert not groups[0].exists()  # a worker that exits removes its group
        runs[1].signal(signal.SIGKILL)
        runs[1].popen.wait(30)
        assert groups[1].exists()  # a killed one cannot ...
    finally:
        stack.stop()
    assert not groups[1].exists()  # ... the launcher's stop removes what it left


def test_a_process_past_its_limit_is_killed_and_its_group_swept():
    """The kernel holds the limit: a process that allocates past it is SIGKILLed (what the run
    worker whose gateways a harness makes allocate gets), and nothing else is touched."""
    code = ("from sandboxes.runtimes.limits import owncg\n"
            "owncg.place('prorl-memcap-test', 64)\n"
            "print('placed', flush=True)\n"
            "blocks = [bytearray(1 << 20) for _ in range(512)]\n"
            "print('survived', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL and proc.stdout == "placed\n", (proc.returncode, proc.stdout,
                                                                            proc.stderr[-2000:])
    assert len(list(owncg.current_memory_cgroup().glob("prorl-memcap-test-*"))) == 1  # left by the kill
    assert owncg.sweep("prorl-memcap-test") == 1
    assert not list(owncg.current_memory_cgroup().glob("prorl-memcap-test-*"))
