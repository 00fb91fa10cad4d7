"""Issue 10, row 14: a command cannot forge its own exit status or cut its output short.

Every attack plants what it can (functions, aliases, options, traps, which carry over to later
commands, as in a real shell), then ``false`` must still be reported as 1, and what a command
printed after a forged marker line must still be in its output. (Within one command the
command's own script decides how its process exits: ``trap 'exit 0' EXIT; false`` exits 0 in any
bash, so that is not a forgery of the status channel.) Run for real in the
local runtime's shell and in a bwrap sandbox on a real sandbox host over HTTP.
"""
from __future__ import annotations

import pytest

from sandboxes.runtimes.shell.persistent import PersistentShell
from tests.sandboxes.conftest import needs_bwrap, sandbox_redis, sandbox_root, start_host  # noqa: F401
from tests.sandboxes.test_host import create

# Each: setup command(s) run first (they may plant functions, traps, options), then a failing
# command. The setup's own status does not matter; the failing command's must be nonzero.
ATTACKS = {
    "printf-function": ["printf() { builtin printf '\\n%s 0 /\\n' \"$@\"; }"],
    "builtin-function": ["builtin() { :; }", "printf() { echo 0 /; }"],
    "command-function": ["command() { echo 0 /; }"],
    "enable-n-printf": ["enable -n printf; printf() { echo 0 /; }"],
    "trap-exit": ["trap 'exit 0' EXIT"],
    "trap-debug-return": ["set -T; trap 'echo 0 /' DEBUG; trap 'return 0' RETURN"],
    "prompt-command": ["PROMPT_COMMAND='echo 0 /'"],
    "errexit-and-aliases": ["set -e; shopt -s expand_aliases; alias echo=printf"],
    "status-fds-of-the-parent": ["for fd in /proc/$$/fd/*; do echo '0 /' > $fd; done 2>/dev/null"],
    "inherited-fds": ["for fd in $(seq 3 64); do echo '0 /' >&$fd; done 2>/dev/null"],
    "exec-fake-shell": ["exec bash -c 'echo 0 /; exit 0'"],
}


IN_ONE_COMMAND = {"inherited-fds", "printf-function", "builtin-function", "command-function", "enable-n-printf",
                  "status-fds-of-the-parent", "errexit-and-aliases", "prompt-command"}


def _attack(run, name: str) -> None:
    """The planted state (functions, aliases, options carry over) then, in later commands, a
    failing command and a forged marker line followed by more output."""
    for command in ATTACKS[name]:
        run(command)
    failing = run("false")
    assert failing.exit_code == 1, (name, failing)
    forged = run("echo before; printf '\\n0 /\\n'; echo '0 /'; echo after; false")
    assert forged.exit_code == 1 and "before" in forged.output and "after" in forged.output, (name, forged)
    if name in IN_ONE_COMMAND:  # the same, all in one command
        combined = run("; ".join(ATTACKS[name]) + "; echo '0 /'; printf '\\n0 /\\n'; echo after; false")
        assert combined.exit_code == 1 and "after" in combined.output, (name, combined)


@pytest.fixture
def local_shell(tmp_path):
    shell = PersistentShell(cwd=str(tmp_path))
    yield shell
    shell.close()


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_local_shell_status_cannot_be_forged(local_shell, name):
    _attack(local_shell.run, name)
    assert local_shell.run("true").exit_code == 0 and local_shell.run("(exit 7)").exit_code == 7


def test_local_shell_state_still_carries_over(local_shell, tmp_path):
    (tmp_path / "sub").mkdir()
    assert local_shell.run("cd sub && export FOO='a b' && f() { echo \"fn $1\"; }; BAR=2").exit_code == 0
    result = local_shell.run('pwd; echo "$FOO"; f x')
    assert result.output == f"{tmp_path / 'sub'}\na b\nfn x\n" and local_shell.cwd == str(tmp_path / "sub")


def test_killing_the_parent_reports_no_status(local_shell):
    result = local_shell.run("kill -9 $$; false")
    assert result.exit_code is None and "new shell" in result.output
    assert local_shell.run("false").exit_code == 1


@needs_bwrap()
def test_bwrap_shell_status_cannot_be_forged(start_host):
    host = start_host(runtime="bwrap")
    for name in sorted(ATTACKS):  # each in its own sandbox: planted state does not pile up
        box = create(host, job_id=f"attack-{name}")
        try:
            _attack(box.exec, name)
        finally:
            box.close()
    box = create(host, job_id="probe")
    try:
        # the parent is not dumpable: its fds, memory and environment are out of reach
        probe = box.exec("ls -l /proc/$$/fd/ 2>&1 | grep -c -- '->'; cat /proc/$$/environ >/dev/null 2>&1 "
                         "&& echo environ-read; head -c1 /proc/$$/mem >/dev/null 2>&1 && echo mem-read; "
                         "echo done")
        assert probe.output.split() == ["0", "done"], probe.output
        assert box.exec("kill -9 $$; false").exit_code is None
        assert box.exec("false").exit_code == 1 and box.exec("echo ok").output == "ok\n"
    finally:
        box.close()
