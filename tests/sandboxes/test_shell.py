from __future__ import annotations

import random
import threading
import time

import psutil
import pytest

from sandboxes.runtimes.shell.persistent import KILL_GRACE_S, PersistentShell


@pytest.fixture
def shell(tmp_path):
    sh = PersistentShell(cwd=str(tmp_path))
    yield sh
    sh.close()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_cwd_and_env_persist(shell, tmp_path):
    (tmp_path / "sub").mkdir()
    assert shell.run("cd sub && export FOO='a b'").exit_code == 0
    result = shell.run('pwd; echo "$FOO"')
    assert result.output == f"{tmp_path / 'sub'}\nabc\n".replace("abc", "a b")
    assert shell.cwd == str(tmp_path / "sub")


def test_a_command_holds_no_descriptor_of_the_shell(shell):
    # the status pipe and the pipe the setup came through stay out of every command
    assert shell.run("ls /proc/self/fd").output.split() == ["0", "1", "2", "3"]  # 3: ls's own


def test_exit_code_and_noninteractive_env(shell):
    assert shell.run("false").exit_code == 1
    assert shell.run("(exit 42)").exit_code == 42
    assert shell.run('echo "$PAGER $GIT_PAGER $TERM $NO_COLOR"').output == "cat cat dumb 1\n"


@pytest.mark.parametrize("command, expected", [
    ("echo 'single' \"double\" \\$HOME", "single double $HOME\n"),
    ("printf '%s\\n' \"it's\"", "it's\n"),
    ("echo one\necho two", "one\ntwo\n"),
    ("cat <<'EOF'\nline 'quoted' $x\nEOF", "line 'quoted' $x\n"),
    ("echo -n no-newline", "no-newline"),
    ("echo 'héllo ✓'", "héllo ✓\n"),
    ("echo 'a'\\''b' \"\\\\\"", "a'b \\\n"),
])
def test_any_command_text_is_framed(shell, command, expected):
    result = shell.run(command)
    assert (result.output, result.exit_code) == (expected, 0)


def test_syntax_error_is_data_and_shell_survives(shell):
    result = shell.run("if then fi (")
    assert result.exit_code == 2 and "syntax error" in result.output
    assert shell.run("echo 'unterminated").exit_code == 2
    assert shell.run("echo ok").output == "ok\n"


def test_stderr_is_merged(shell):
    assert shell.run("echo out; echo err >&2; ls /nonexistent-dir").output.startswith("out\nerr\n")


def test_exit_ends_only_the_command(shell, tmp_path):
    shell.run("cd /usr && export KEEP=1")
    old_pid = shell.pid
    result = shell.run("exit 3")
    assert result.exit_code == 3 and result.output == ""
    assert shell.pid == old_pid and shell.run('pwd; echo "$KEEP"').output == "/usr\n1\n"


def test_killing_the_shell_restarts_it_and_keeps_cwd(shell, tmp_path):
    shell.run("cd /usr")
    old_pid = shell.pid
    result = shell.run("kill -9 $$")
    assert result.exit_code is None and "new shell" in result.output
    assert shell.pid != old_pid and not psutil.pid_exists(old_pid)
    assert shell.run("pwd").output == "/usr\n"


def test_stdin_reading_commands_do_not_hang(shell):
    start = time.monotonic()
    assert shell.run("cat; read x; echo got=$x", timeout=5).output == "got=\n"
    assert shell.run("python3 -c 'import sys; print(len(sys.stdin.read()))'", timeout=5).output == "0\n"
    assert time.monotonic() - start < 2


def test_timeout_kills_sleep_and_process_tree(shell):
    start = time.monotonic()
    result = shell.run("""echo before; bash -c 'sleep 100 & echo "$! $$"; exec sleep 100'""",
                       timeout=0.5)
    assert time.monotonic() - start < 0.5 + KILL_GRACE_S
    assert result.timed_out and result.exit_code is None and not result.interrupted
    assert result.output.startswith("before\n")
    pids = [int(pid) for pid in result.output.splitlines()[1].split()]
    assert len(pids) == 2 and _wait(lambda: all(gone(pid) for pid in pids))
    assert psutil.Process(shell.pid).children(recursive=True) == []
    assert shell.run("echo alive").output == "alive\n"


def test_builtin_loop_timeout_keeps_the_shell_and_its_state(shell, tmp_path):
    (tmp_path / "d").mkdir()
    shell.run("cd d && f() { echo kept; }")
    old_pid = shell.pid
    result = shell.run("while :; do :; done", timeout=0.3)
    assert result.timed_out and result.exit_code is None and "killed" in result.output
    assert result.duration_s < 0.3 + KILL_GRACE_S + 1
    assert shell.pid == old_pid  # the loop ran in the command's subshell, not in the shell
    assert shell.run("pwd; f").output == f"{tmp_path / 'd'}\nkept\n"


def test_interrupt_from_another_thread(shell):
    results = []
    worker = threading.Thread(
        target=lambda: results.append(shell.run("sleep 100 & echo $!; wait", timeout=30)))
    worker.start()
    # interrupt once the background sleep runs (not merely once the subshell exists: on a busy
    # node the command may not have got that far yet)
    assert _wait(lambda: _runs(shell.pid, "sleep"), 60)
    shell.interrupt()
    worker.join(60)
    assert not worker.is_alive()
    result = results[0]
    # interrupted, not timed out: it ended well before its 30 s timeout
    assert result.interrupted and not result.timed_out and result.exit_code is None
    assert _wait(lambda: gone(int(result.output.split()[0])), 30)
    assert shell.run("echo after").output == "after\n"


def test_output_truncated_keeping_head_and_tail(tmp_path):
    sh = PersistentShell(cwd=str(tmp_path), output_limit=1000)
    try:
        result = sh.run("seq 1 100000")
        assert result.truncated and result.exit_code == 0
        assert result.output.startswith("1\n2\n3\n") and result.output.endswith("99999\n100000\n")
        assert "chars cut ...]" in result.output and len(result.output) < 1100
        huge = sh.run("head -c 50000000 /dev/zero | tr '\\0' x; echo; echo END")
        assert huge.truncated and huge.output.startswith("xxx") and huge.output.endswith("x\nEND\n")
        cut = int(huge.output.split("[... ")[1].split(" chars cut")[0])
        assert abs(cut - 50_000_006 + 1000) < 100
        assert sh.run("echo small").output == "small\n"
    finally:
        sh.close()


def test_invalid_utf8_output_is_replaced(shell):
    assert shell.run("printf 'a\\377b'").output == "a\ufffdb"


def test_close_kills_background_processes(tmp_path):
    sh = PersistentShell(cwd=str(tmp_path))
    background = int(sh.run("sleep 100 & echo $!").output)
    assert not gone(background)
    pid = sh.pid
    sh.close()
    assert not psutil.pid_exists(pid)
    # close() waits (boundedly) for what it killed; on a loaded node the kernel may take longer
    # to finish a SIGKILLed process, so look until it is gone rather than once
    assert _wait(lambda: gone(background), 30)
    sh.close()  # idempotent


def test_many_round_trips_each_get_their_own_output(shell):
    """Back-to-back commands: every result is its own command's output and status, none shifted
    (the speed of this path is bench/action_latency.py's, not a test's)."""
    for i in range(300):
        result = shell.run(f"echo {i}; (exit {i % 3})")
        assert (result.output, result.exit_code) == (f"{i}\n", i % 3)


def _runs(pid: int, name: str) -> bool:
    """Whether a descendant of ``pid`` named ``name`` is alive (processes may end while we look)."""
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if child.name() == name:
                return True
        except psutil.NoSuchProcess:
            continue
    return False


def _wait(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_shell_outlives_the_thread_that_created_it(tmp_path):
    made = []
    creator = threading.Thread(target=lambda: made.append(PersistentShell(cwd=str(tmp_path))))
    creator.start()
    creator.join()
    sh = made[0]
    try:
        time.sleep(0.2)  # PR_SET_PDEATHSIG would have fired by now if the creator had forked it
        assert psutil.pid_exists(sh.pid) and sh.run("echo alive").output == "alive\n"
    finally:
        sh.close()


def test_interrupting_a_builtin_loop_keeps_the_shell(shell):
    results = []
    worker = threading.Thread(target=lambda: results.append(shell.run("while :; do :; done", timeout=30)))
    worker.start()
    time.sleep(0.3)
    old_pid = shell.pid
    shell.interrupt()
    worker.join(KILL_GRACE_S + 3)
    assert results and results[0].interrupted and "killed" in results[0].output
    assert shell.pid == old_pid and shell.run("echo back").output == "back\n"


def test_kills_at_any_moment_never_lose_the_state(shell, tmp_path):
    """Interrupts land anywhere in a command's life (sourcing the state, running, dumping it):
    what the earlier command left must survive every one of them."""
    (tmp_path / "d").mkdir()
    shell.run("cd d && f() { echo kept; } && export K=1 && set -o pipefail")
    stop = threading.Event()

    def killer():
        while not stop.is_set():
            shell.interrupt()
            time.sleep(random.uniform(0, 0.002))

    thread = threading.Thread(target=killer)
    thread.start()
    try:
        results = [shell.run("true") for _ in range(150)]
    finally:
        stop.set()
        thread.join()
    assert sum(result.interrupted for result in results) > 10  # the kills did land
    assert shell.run('pwd; f; echo "$K"; [[ -o pipefail ]] && echo pipefail').output == (
        f"{tmp_path / 'd'}\nkept\n1\npipefail\n")


def test_a_shell_that_does_not_start_leaves_no_descriptor(tmp_path):
    import os

    from prorl_celery.errors import SandboxError

    def fail_to_start() -> None:
        with pytest.raises(SandboxError, match="did not start"):
            PersistentShell(argv=["true"], cwd=str(tmp_path))  # exits before it answers

    fail_to_start()  # once first: what the process opens once (the guardian's pipe) is not a leak
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        fail_to_start()
    assert len(os.listdir("/proc/self/fd")) == before


def _baseline_written_ns(shell: PersistentShell) -> int:
    import os

    return os.stat(shell._state_base + ".e").st_mtime_ns


def test_a_claim_without_variables_takes_its_directory_without_a_dump(shell, tmp_path):
    """A claim's ulimit and cd export nothing: the baseline's exports stand (its file is not
    written again: no dump subshell was forked), and the directory is the one commands start
    in, also after a command killed before its state was dumped."""
    from sandboxes.base import Limits

    (tmp_path / "repo").mkdir()
    written = _baseline_written_ns(shell)
    time.sleep(0.05)  # past the coarse clock of the file's timestamp
    shell.adopt({}, Limits(nofile=300), str(tmp_path / "repo"))
    assert _baseline_written_ns(shell) == written
    assert shell.run("pwd; ulimit -n").output == f"{tmp_path / 'repo'}\n300\n"
    assert shell.run("kill -9 $BASHPID").exit_code == 137  # its subshell, before its dump
    assert shell.run("pwd; echo ${OLDPWD-unset}").output == f"{tmp_path / 'repo'}\n{tmp_path}\n"
    assert shell.run("export FOO=1; cd ..").exit_code == 0
    assert shell.run('pwd; echo "$FOO"').output == f"{tmp_path}\n1\n"


def test_a_claim_with_variables_dumps_the_baseline_again(shell, tmp_path):
    written = _baseline_written_ns(shell)
    time.sleep(0.05)
    shell.adopt({"TASK": "a b"}, None, None)
    assert _baseline_written_ns(shell) != written
    assert shell.run('echo "$TASK"').output == "a b\n"
    assert shell.run("unset TASK").exit_code == 0
    assert shell.run('echo "${TASK-gone}"').output == "gone\n"
