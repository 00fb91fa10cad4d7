"""The contract every sandbox runtime passes (in the spirit of Gymnasium's ``check_env``).

Parametrized over the runtimes in this process (``local``, ``bwrap``, ``singularity``) and over
HTTP (``remote``: a sandbox host's default runtime driven by handle, as a stage task does).
``local`` skips the isolation half; ``singularity`` is skipped when no binary exists.
"""
from __future__ import annotations

import os
import socket
import time

import pytest

from sandboxes.base import Limits, SandboxSpec
from sandboxes.check import check_sandbox
from tests.sandboxes.conftest import needs_bwrap
from tests.sandboxes.test_host import create

KINDS = ["local", pytest.param("bwrap", marks=needs_bwrap()), "singularity",
         pytest.param("remote", marks=needs_bwrap())]
SPEC = SandboxSpec(env={"GREETING": "hello world"}, limits=Limits(memory_mb=2048))


@pytest.fixture(params=KINDS)
def box(request, sandbox_root):
    kind = request.param
    if kind == "remote":
        host = request.getfixturevalue("start_host")()
        sandbox = create(host, "contract-job", spec=SPEC.model_dump())
    elif kind == "singularity":
        from sandboxes.runtimes.singularity import SingularitySandbox

        if not SingularitySandbox.available():
            pytest.skip("no apptainer/singularity binary on this machine")
        image = os.environ.get("PRORL_TEST_SIF")
        if not image:
            pytest.skip("set PRORL_TEST_SIF to a .sif (or docker://...) to run it")
        sandbox = SingularitySandbox(SPEC.model_copy(update={"image": image}), "contract-job",
                                     {"root": str(sandbox_root)})
    else:
        from sandboxes.registry import load_runtime

        sandbox = load_runtime(kind)(SPEC, "contract-job", {"root": str(sandbox_root)})
    sandbox.kind = kind
    yield sandbox
    sandbox.close()


def test_contract(box):
    """``check_sandbox`` (shell state, timeouts, interrupts, output caps, files, stat, close) plus
    what this spec asks of the shell and the details of stat the check leaves out."""
    assert box.exec('echo "$GREETING"').output == "hello world\n"  # the spec's env reaches the shell
    assert box.exec('echo "$PAGER $GIT_PAGER"').output == "cat cat\n"
    # stat: mode and mtime as written, the workspace itself, absolute paths and links never followed out
    box.exec("cd ~ && printf 'made inside' > made.txt && ln -sf /etc/passwd sneaky && mkdir -p tree "
             "&& chmod 750 tree && chmod 640 made.txt")
    made = box.stat("made.txt")
    assert (made.kind, made.size, made.mode) == ("file", len(b"made inside"), 0o640)
    assert abs(made.mtime - time.time()) < 60
    assert box.stat("tree").kind == "dir" and box.stat("tree").mode == 0o750
    assert box.stat("sneaky").kind == "link" and box.stat("sneaky").size == len("/etc/passwd")
    assert box.stat(".").kind == "dir" and box.stat(info_workdir(box)).kind == "dir"
    for path in ("sneaky/x", "/etc/passwd"):
        with pytest.raises(PermissionError):
            box.stat(path)
    info = box.info()
    check_sandbox(box)  # raises NonConformant naming every promise the sandbox breaks; closes it
    if box.kind != "remote":
        assert not os.path.exists(info["workspace"])


def info_workdir(box) -> str:
    """The workspace as the sandbox sees it (an absolute path inside it)."""
    return box.exec("cd ~ && pwd").output.strip()


def test_contract_isolation(box):
    if box.kind == "local":
        pytest.skip("local has no isolation")
    assert box.exec("touch ~/ok /tmp/ok").exit_code == 0
    for path in ("/usr/pwned", "/etc/pwned", "/pwned", "/opt/pwned"):
        assert box.exec(f"touch {path}").exit_code != 0, path
        assert not os.path.exists(path)
    # the host's processes are invisible
    assert box.exec(f"kill -0 {os.getpid()} 2>/dev/null || echo hidden").output == "hidden\n"
    assert int(box.exec("ls /proc | grep -c '^[0-9]'").output) < 10
    # the host's loopback services are unreachable with the network off
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        probe = box.exec(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\"")
        assert probe.exit_code != 0 and ("refused" in probe.output or "unreachable" in probe.output)
