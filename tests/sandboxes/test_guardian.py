"""The guardian kills what a host still holds when the host's end of its pipe closes."""
from __future__ import annotations

import os
import signal
import subprocess

import psutil

from sandboxes.runtimes.shell.guardian import Guardian
from tests.sandboxes.conftest import wait_until


def _shell_running_a_child() -> tuple[subprocess.Popen, int]:
    """A bash in its own session, running a sleep: (the shell, the sleep's pid)."""
    shell = subprocess.Popen(["bash", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE,
                             start_new_session=True, text=True)
    return shell, int(shell.stdout.readline())


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_replaced_guardian_still_kills_everything_held():
    guardian = Guardian()
    first, first_child = _shell_running_a_child()
    second, second_child = _shell_running_a_child()
    dropped, dropped_child = _shell_running_a_child()
    try:
        guardian.hold(first.pid)
        guardian.hold(dropped.pid)
        guardian.drop(dropped.pid)
        old = guardian.pid
        os.kill(old, signal.SIGKILL)
        assert wait_until(lambda: _gone(old), timeout=5)
        guardian.hold(second.pid)  # notices the dead guardian, starts another with the whole list
        assert guardian.pid != old
        guardian._proc.stdin.close()  # what the host's death does to the pipe
        for pid in (first.pid, first_child, second.pid, second_child):
            assert wait_until(lambda: _gone(pid), timeout=5), pid
        assert not _gone(dropped.pid) and not _gone(dropped_child)
    finally:
        for shell in (first, second, dropped):
            if not _gone(shell.pid):
                os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
