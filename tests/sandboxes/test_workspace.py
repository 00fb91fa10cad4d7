"""The host side of a sandbox's files: nothing the sandbox plants in its workspace (symlinks,
FIFOs, ``..``) makes the host read or write outside it."""
from __future__ import annotations

import os

import pytest

from sandboxes.runtimes import workspace as ws_module
from sandboxes.runtimes.workspace import Workspace

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    return Workspace(root, "/workspace")


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("host secret")
    return path


def planted(ws: Workspace, secret) -> None:
    """What a hostile sandbox could leave in its workspace."""
    root = ws.host_dir
    (root / "dir").mkdir()
    os.symlink(str(secret), root / "abs-link")
    os.symlink("../../secret.txt", root / "dir" / "rel-escape")
    os.symlink(str(secret.parent), root / "dir-link")
    os.symlink("../real.txt", root / "dir" / "ok-link")
    (root / "real.txt").write_text("inside")
    os.mkfifo(root / "fifo")


@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "component-walk"])
def test_reads_and_writes_never_leave_the_workspace(ws, secret, monkeypatch, openat2):
    if not openat2:
        monkeypatch.setattr(ws_module, "_have_openat2", False)
    planted(ws, secret)
    for path in ("abs-link", "dir/rel-escape", "dir-link/secret.txt", "../secret.txt",
                 "dir/../../secret.txt", str(secret), "/workspace/../secret.txt"):
        with pytest.raises(PermissionError):
            ws.read_bytes(path)
    for path in ("abs-link", "dir-link/new.txt", "dir/rel-escape", "../new.txt"):
        with pytest.raises(PermissionError):
            ws.write_bytes(path, b"pwned")
    assert secret.read_text() == "host secret"
    assert not (secret.parent / "new.txt").exists()
    with pytest.raises(OSError, match="not a regular file"):
        ws.read_bytes("fifo")  # would block a host thread forever if opened for reading blindly
    assert ws.read_bytes("/workspace/real.txt") == b"inside"
    if openat2:  # a symlink that stays inside is followed (the component walk refuses all)
        assert ws.read_bytes("dir/ok-link") == b"inside"
    # stat: what lies behind a link that leads out is never reported; the link itself is
    for path in ("dir-link/secret.txt", "dir/rel-escape/x", "../secret.txt", "dir/../../secret.txt",
                 str(secret), "/workspace/../secret.txt"):
        with pytest.raises(PermissionError):
            ws.stat(path)
    assert ws.stat("abs-link").kind == "link" and ws.stat("abs-link").size == len(str(secret))
    assert ws.stat("fifo").kind == "other"  # looked at, never opened: no blocking
    assert (ws.stat("/workspace/real.txt").kind, ws.stat("real.txt").size) == ("file", 6)
    assert ws.stat("/workspace").kind == ws.stat("dir").kind == "dir"


def test_binary_files_and_absolute_paths(ws):
    data = bytes(range(256)) * 64 + b"\x00\r\n"
    ws.write_bytes("/workspace/a/b/c.bin", data)
    assert (ws.host_dir / "a/b/c.bin").read_bytes() == data
    assert ws.read_bytes("a/b/c.bin") == data
    with pytest.raises(FileNotFoundError):
        ws.read_bytes("a/missing")
    with pytest.raises(PermissionError):
        ws.read_bytes("/etc/passwd")


def test_remove_handles_what_the_sandbox_locked(ws):
    locked = ws.host_dir / "locked" / "deeper"
    locked.mkdir(parents=True)
    (locked / "f").write_text("x")
    locked.chmod(0)
    (ws.host_dir / "locked").chmod(0)
    ws.remove()
    assert not ws.host_dir.exists()
