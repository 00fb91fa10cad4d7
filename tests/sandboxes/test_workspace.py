"""The host side of a sandbox's files: nothing the sandbox plants in its workspace (symlinks,
FIFOs, ``..``) makes the host read or write outside it."""
from __future__ import annotations

import io
import os
import tarfile

import pytest

from sandboxes.runtimes import workspace as ws_module
from sandboxes.runtimes.archive import extract_archive
from sandboxes.runtimes.workspace import Workspace


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


def test_binary_files_and_absolute_paths(ws):
    data = bytes(range(256)) * 64 + b"\x00\r\n"
    ws.write_bytes("/workspace/a/b/c.bin", data)
    assert (ws.host_dir / "a/b/c.bin").read_bytes() == data
    assert ws.read_bytes("a/b/c.bin") == data
    with pytest.raises(FileNotFoundError):
        ws.read_bytes("a/missing")
    with pytest.raises(PermissionError):
        ws.read_bytes("/etc/passwd")


def test_copy_in_and_out_keep_a_tree(ws, tmp_path):
    src = tmp_path / "repo"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "pkg" / "sub" / "data.bin").write_bytes(os.urandom(300_000))
    (src / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "run.sh").chmod(0o755)
    os.symlink("pkg/sub/data.bin", src / "link")
    os.link(src / "run.sh", src / "hardlink.sh")
    assert ws.copy_in(str(src), "/workspace/repo") >= 6
    inside = ws.host_dir / "repo"
    assert (inside / "pkg/sub/data.bin").read_bytes() == (src / "pkg/sub/data.bin").read_bytes()
    assert os.readlink(inside / "link") == "pkg/sub/data.bin"
    assert os.stat(inside / "run.sh").st_mode & 0o777 == 0o755
    assert (inside / "hardlink.sh").read_text() == "#!/bin/sh\necho hi\n"
    out = tmp_path / "out"
    ws.copy_out("repo", str(out))
    assert (out / "pkg/sub/data.bin").read_bytes() == (src / "pkg/sub/data.bin").read_bytes()
    assert os.readlink(out / "link") == "pkg/sub/data.bin"
    ws.copy_out("repo/run.sh", str(tmp_path / "one"))  # a single file
    assert (tmp_path / "one" / "run.sh").read_text().endswith("echo hi\n")


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def _info(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", link: str = "",
          mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.size = kind, link, mode, len(data)
    return info, (data if kind == tarfile.REGTYPE else None)


def test_hostile_archives_stay_inside(ws, secret):
    for evil in ("../escape.txt", "a/../../escape.txt"):
        with pytest.raises(PermissionError):
            ws.put_archive("", _tar(_info(evil, data=b"x")))
    ws.put_archive("", _tar(_info("/tmp/abs.txt", data=b"x")))  # absolute names land inside
    assert (ws.host_dir / "tmp" / "abs.txt").read_bytes() == b"x"
    # a symlink to the outside, then a file "through" it: the write must not follow the link
    with pytest.raises(PermissionError):
        ws.put_archive("", _tar(_info("out", tarfile.SYMTYPE, link=str(secret.parent)),
                                _info("out/secret.txt", data=b"pwned")))
    assert secret.read_text() == "host secret"
    # a file over an existing symlink replaces the link, never writes through it
    os.symlink(str(secret), ws.host_dir / "victim")
    ws.put_archive("", _tar(_info("victim", data=b"mine", mode=0o4755)))
    assert secret.read_text() == "host secret"
    assert (ws.host_dir / "victim").read_bytes() == b"mine"
    assert os.stat(ws.host_dir / "victim").st_mode & 0o7777 == 0o755  # set-uid dropped
    ws.put_archive("", _tar(_info("dev", tarfile.CHRTYPE), _info("fifo", tarfile.FIFOTYPE)))
    assert not (ws.host_dir / "dev").exists() and not (ws.host_dir / "fifo").exists()


def test_copy_out_leaves_out_links_that_point_outside(ws, secret, tmp_path):
    planted(ws, secret)
    os.unlink(ws.host_dir / "fifo")
    out = tmp_path / "fetched"
    ws.copy_out("", str(out))
    assert (out / "real.txt").read_text() == "inside"
    assert not os.path.lexists(out / "abs-link") and not os.path.lexists(out / "dir-link")
    assert os.readlink(out / "dir" / "ok-link") == "../real.txt"


def test_extract_skips_members_escaping_the_destination(tmp_path):
    archive = _tar(_info("../up.txt", data=b"x"), _info("fine.txt", data=b"ok"))
    extract_archive(archive, tmp_path / "dest")
    assert (tmp_path / "dest" / "fine.txt").read_bytes() == b"ok"
    assert not (tmp_path / "up.txt").exists()


def test_remove_handles_what_the_sandbox_locked(ws):
    locked = ws.host_dir / "locked" / "deeper"
    locked.mkdir(parents=True)
    (locked / "f").write_text("x")
    locked.chmod(0)
    (ws.host_dir / "locked").chmod(0)
    ws.remove()
    assert not ws.host_dir.exists()
