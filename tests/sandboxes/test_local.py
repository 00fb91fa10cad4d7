from __future__ import annotations

import logging
import os

import psutil
import pytest

from prorl_celery.errors import SandboxError, UnknownPlugin
from sandboxes import registry
from sandboxes.runtimes import local
from sandboxes.base import Limits, Sandbox, SandboxSpec
from sandboxes.runtimes.local import LocalConfig, LocalSandbox


@pytest.fixture
def box(tmp_path):
    sandbox = LocalSandbox(SandboxSpec(env={"MY_VAR": "x y"}), "job/1", {"root": str(tmp_path)})
    yield sandbox
    sandbox.close()


def test_implements_protocol_and_says_no_isolation(box, tmp_path):
    assert isinstance(box, Sandbox)
    info = box.info()
    assert info["isolation"] == "none" and info["runtime"] == "local"
    assert info["pid"] == box.shell.pid and psutil.pid_exists(info["pid"])
    assert box.host_dir.parent == tmp_path and box.host_dir.is_dir()


def test_shell_starts_in_workspace_with_env(box):
    result = box.exec('pwd; echo "$MY_VAR"; echo "$HOME"')
    assert result.output == f"{box.host_dir}\nx y\n{box.host_dir}\n"


def test_relative_workdir_is_inside_workspace(tmp_path):
    sandbox = LocalSandbox(SandboxSpec(workdir="repo/src"), "j", LocalConfig(root=str(tmp_path)))
    try:
        assert sandbox.exec("pwd").output == f"{sandbox.host_dir / 'repo' / 'src'}\n"
    finally:
        sandbox.close()


def test_missing_absolute_workdir_is_an_error(tmp_path):
    with pytest.raises(SandboxError):
        LocalSandbox(SandboxSpec(workdir="/no/such/dir"), "j", {"root": str(tmp_path)})
    assert list(tmp_path.iterdir()) == []  # the half-made workspace was removed


def test_files_are_binary_safe(box):
    data = bytes(range(256)) * 4 + b"\r\n\x00"
    box.write_file("deep/dir/blob.bin", data)
    assert (box.host_dir / "deep/dir/blob.bin").read_bytes() == data
    assert box.read_file("deep/dir/blob.bin") == data
    assert box.exec("wc -c < deep/dir/blob.bin").output.strip() == str(len(data))
    absolute = str(box.host_dir / "abs.txt")
    box.write_file(absolute, b"abs")
    assert box.read_file(absolute) == b"abs"
    with pytest.raises(FileNotFoundError):
        box.read_file("missing")


def test_close_kills_shell_and_removes_workspace(tmp_path):
    sandbox = LocalSandbox(SandboxSpec(), "j", {"root": str(tmp_path)})
    sandbox.exec("sleep 100 &")
    pid, workspace = sandbox.shell.pid, sandbox.host_dir
    children = psutil.Process(pid).children(recursive=True)
    sandbox.close()
    sandbox.close()
    assert not workspace.exists() and not psutil.pid_exists(pid)
    assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children)


def test_rlimits_apply(tmp_path):
    spec = SandboxSpec(limits=Limits(fsize_mb=1, memory_mb=300))
    sandbox = LocalSandbox(spec, "j", {"root": str(tmp_path)})
    try:
        big = sandbox.exec("head -c 3000000 /dev/zero > big; echo done")
        assert os.path.getsize(sandbox.host_dir / "big") <= 1024 * 1024
        assert "File size limit exceeded" in big.output or "too large" in big.output
        oom = sandbox.exec("python3 -c 'x = bytearray(600 * 2**20)'")
        assert oom.exit_code != 0 and "MemoryError" in oom.output
    finally:
        sandbox.close()


def test_warns_once(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(local, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="sandboxes.runtimes.local"):
        for _ in range(2):
            LocalSandbox(SandboxSpec(), "j", {"root": str(tmp_path)}).close()
    warnings = [r for r in caplog.records if "NO isolation" in r.getMessage()]
    assert len(warnings) == 1


def test_config_forbids_unknown_fields():
    with pytest.raises(ValueError):
        LocalConfig(rooot="/tmp")


def test_registry_by_name_and_dotted_path():
    assert registry.load_runtime("local") is LocalSandbox
    assert registry.load_runtime("sandboxes.runtimes.local:LocalSandbox") is LocalSandbox
    assert registry.load_runtime("sandboxes.runtimes.local.LocalSandbox") is LocalSandbox
    assert "local" in registry.available_runtimes()


def test_unknown_runtime_lists_known_names():
    with pytest.raises(UnknownPlugin, match="known: bwrap, local, singularity"):
        registry.load_runtime("docker")
    with pytest.raises(UnknownPlugin, match="cannot load"):
        registry.load_runtime("sandboxes.nope:Thing")
    with pytest.raises(UnknownPlugin, match="none of the allowed packages"):
        registry.load_runtime("subprocess:Popen")  # a request cannot name arbitrary code


def test_create_sandbox_uses_spec_runtime_or_default(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORL_SANDBOX_RUNTIME", "local")
    from config.settings import get_settings

    get_settings.cache_clear()
    try:
        sandbox = registry.create_sandbox(SandboxSpec(), "j", {"root": str(tmp_path)})
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
    try:
        assert isinstance(sandbox, LocalSandbox) and sandbox.exec("echo ok").output == "ok\n"
    finally:
        sandbox.close()
    with pytest.raises(UnknownPlugin):
        registry.create_sandbox(SandboxSpec(runtime="nonexistent"), "j")
