"""Row 6 of issue 10: ``sandbox.env`` never reaches the host-side start.

Before, a request's ``LD_PRELOAD`` (or ``PATH``) was the environment of the ``setpriv``/``bwrap``
the host starts as root. Now the API refuses the dangerous names with a 400 naming
``instance.sandbox.env``; and a variable that is allowed is exported by the shell inside the
sandbox only: the host-side process's own ``/proc/<pid>/environ`` (read as root) and command line
hold none of the spec's variables, while the shell inside sees them, also in a warm sandbox
claimed for the job and after its shell was restarted.
"""
from __future__ import annotations

import os
import secrets
import stat
import time

import psutil
import pytest
import requests

from tests.conftest import submit, wait
from tests.sandboxes.conftest import needs_bwrap, sandbox_redis, sandbox_root, start_host  # noqa: F401
from tests.sandboxes.test_host import create, entry_of

REFUSED = [
    {"LD_PRELOAD": "/workspace/evil.so"},
    {"LD_LIBRARY_PATH": "/tmp"},
    {"BASH_ENV": "/workspace/evil.sh"},
    {"ENV": "/workspace/evil.sh"},
    {"BASH_FUNC_ls%%": "() { id; }"},
    {"SHELLOPTS": "xtrace"},
    {"PS4": "$(id)"},
    {"PROMPT_COMMAND": "id"},
    {"IFS": "/"},
    {"GLIBC_TUNABLES": "glibc.malloc.mxfast=1"},
    {"PATH": "/tmp/planted:/usr/bin:/bin"},
    {"PATH": "/workspace/bin:/usr/bin"},
    {"PATH": "bin:/usr/bin"},
    {"PATH": "/usr/bin::/bin"},
    {"not a name": "x"},
    {"NUL": "a\u0000b"},
]


@pytest.mark.parametrize("env", REFUSED, ids=[next(iter(e)) + (":" + e.get("PATH", "")) * ("PATH" in e)
                                              for e in REFUSED])
def test_the_api_refuses_dangerous_sandbox_env(api, env):
    instance = {"data_source": "shell", "commands": ["id"], "sandbox": {"runtime": "bwrap", "env": env}}
    response = requests.post(f"{api}/jobs", json={"instance": instance}, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["field"] == "instance.sandbox.env", error
    name = next(iter(env))
    assert (name in error["message"] or "PATH" in error["message"] or "shell variable" in error["message"]
            or "NUL" in error["message"]), error


def test_the_host_refuses_them_to_its_own_token(start_host):
    host = start_host(runtime="bwrap", host_id=f"env-{os.getpid()}-{secrets.token_hex(3)}")
    response = requests.post(f"{host.address}/sandboxes", timeout=30,
                             headers={"Authorization": f"Bearer {host.token}"},
                             json={"job_id": "evil", "spec": {"env": {"LD_PRELOAD": "/x.so"}}})
    assert response.status_code == 400 and "LD_PRELOAD" in response.text, response.text


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        pairs = [item.decode(errors="replace").partition("=") for item in fh.read().split(b"\0") if item]
    return {name: value for name, _, value in pairs}


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().replace(b"\0", b" ").decode(errors="replace")


def _host_side(info: dict) -> list[int]:
    """The host-side processes of a bwrap sandbox: the outer bwrap (after setpriv's exec) and
    whatever wraps it, up to the host."""
    return [info["pid"]]


@needs_bwrap()
@pytest.mark.parametrize("warm", [0, 1], ids=["cold", "warm"])
def test_spec_env_is_inside_only(start_host, warm):
    secret = f"s3cret-{secrets.token_hex(6)}"
    env = {"AGENT_TOKEN": secret, "PATH": "/opt/tools/bin:/usr/local/bin:/usr/bin:/bin",
           "GREETING": "it's \"quoted\"\nand two lines"}
    host = start_host(runtime="bwrap", warm=warm, host_id=f"env-{os.getpid()}-{secrets.token_hex(3)}")
    if warm:  # the first request of a kind starts warming that kind; the job's takes that one
        create(host, "prime", spec={"runtime": "bwrap"})
        time.sleep(1.5)
    asked_at = time.time()
    box = create(host, "env-job", spec={"runtime": "bwrap", "env": env})
    info = entry_of(host, box).info
    if warm:
        assert psutil.Process(info["pid"]).create_time() < asked_at  # started before the ask
    for pid in _host_side(info):
        outer = _environ(pid)
        assert not set(env) - {"PATH"} & set(outer), outer
        assert outer.get("PATH") != env["PATH"] and secret not in str(outer), outer
        assert secret not in _cmdline(pid) and "/opt/tools" not in _cmdline(pid)
        assert not any(name.startswith("LD_") for name in outer)
    inside = box.exec("printf '%s|%s|%s' \"$AGENT_TOKEN\" \"$PATH\" \"$GREETING\"").output
    assert inside == f"{secret}|{env['PATH']}|{env['GREETING']}", inside
    box.exec("kill -9 $$")  # the shell restarts: the variables are exported again, inside only
    again = entry_of(host, box).info
    assert box.exec("echo $AGENT_TOKEN").output == f"{secret}\n"
    assert secret not in str(_environ(again["pid"])) and secret not in _cmdline(again["pid"])
    assert again["pid"] != info["pid"]


def test_through_the_service_an_allowed_variable_reaches_the_shell(api):
    job = wait(api, submit(api, {"data_source": "shell", "commands": ["echo \"$TASK_NAME\""],
                                 "sandbox": {"runtime": "bwrap", "env": {"TASK_NAME": "fine one"}}}))
    assert job["status"] == "completed", job
    assert job["result"]["steps"][0]["output"] == "fine one\n"


def test_local_runtime_finds_its_shell_on_the_hosts_path_not_the_specs(tmp_path, sandbox_root):  # noqa: F811
    """``local`` is the host-side process itself: a PATH in its spec cannot pick which binary."""
    from sandboxes.base import SandboxSpec
    from sandboxes.runtimes.local import LocalSandbox

    planted = tmp_path / "opt" / "bin"
    planted.mkdir(parents=True)
    fake = planted / "bash"
    proof = tmp_path / "planted-ran"
    fake.write_text(f"#!/bin/sh\ntouch {proof}\nexec /bin/bash \"$@\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{planted}:/usr/bin:/bin"}
    with pytest.raises(ValueError, match="PATH entry"):  # the validator refuses it ...
        SandboxSpec(env=env)
    # ... and were it let through, the host's PATH still picks the shell
    box = LocalSandbox(SandboxSpec.model_construct(env=env), "local-path", {"root": str(sandbox_root)})
    try:
        assert box.exec("echo ok").output == "ok\n"
        assert not proof.exists()
        assert os.path.isabs(box.shell.argv[0]) and box.shell.argv[0] != str(fake)
    finally:
        box.close()
