"""Issue 10 row 11: a sandbox root and a uid lock directory that no other local user controls.

A local user (a uid that is not the host's) pre-creates the directories, makes them writable to
all, or plants symlinks; the host must refuse to start, and no removal may follow a symlink to
a victim directory. Hosts are real processes; sandboxes are real bwrap sandboxes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxes.runtimes.bwrap import BwrapSandbox
from sandboxes.base import SandboxSpec
from sandboxes.safedirs import UnsafeDirectory, remove_tree
from tests.sandboxes.conftest import (REPO, needs_bwrap, sandbox_redis, sandbox_root,  # noqa: F401
                                      start_host)
from tests.conftest import wait_until
from tests.sandboxes.test_host import create, entry_of

pytestmark = [needs_bwrap(), pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play "
                                                "another local user")]
OTHER_UID = 54321  # the attacker


def start_refused(root: Path) -> str:
    """Start a host whose sandbox root is ``root``; it must exit; returns what it said."""
    argv = [sys.executable, "-m", "sandboxes.host.main", "--no-register", "--runtimes", "bwrap",
            "--host-id", "victim-host", "--runtime-config", json.dumps({"bwrap": {"root": str(root)}})]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode != 0 and "sandbox-host ready" not in proc.stdout, proc.stdout
    return proc.stderr


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A directory that must come through untouched: its file, and its mode."""
    directory = tmp_path / "victim"
    directory.mkdir(mode=0o750)
    (directory / "precious.txt").write_text("keep me")
    return directory


def assert_intact(victim: Path) -> None:
    assert (victim / "precious.txt").read_text() == "keep me"
    assert victim.stat().st_mode & 0o7777 == 0o750


def test_a_root_another_user_owns_or_all_can_write_or_a_symlink_is_refused(tmp_path, victim):
    owned = tmp_path / "owned"
    owned.mkdir(mode=0o711)
    os.chown(owned, OTHER_UID, OTHER_UID)
    assert "belongs to uid 54321" in start_refused(owned)
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    assert "writable by others" in start_refused(open_to_all)
    link = tmp_path / "link"
    link.symlink_to(victim)
    assert "is a symlink" in start_refused(link)
    # the host directory <root>/<host id> pre-created by the attacker inside a good root
    good = tmp_path / "good"
    good.mkdir(mode=0o711)
    (good / "victim-host").symlink_to(victim)
    assert "refuses to start" in start_refused(good)
    assert_intact(victim)


def test_symlinks_in_a_workspace_are_not_followed_when_it_is_removed(start_host, sandbox_root,
                                                                      victim):
    host = start_host(runtime="bwrap")
    box = create(host, "planter")
    workspace = Path(entry_of(host, box).info["workspace"])
    planted = box.exec(f"ln -s {victim} link && ln -s {victim}/precious.txt file-link && "
                       f"mkdir -p locked/deeper && ln -s {victim} locked/deeper/link && "
                       f"chmod 000 locked && echo planted")
    assert planted.output == "planted\n"
    box.close()
    trash = workspace.with_name(f".trash-{workspace.name}")  # moved aside, then deleted, after the kill
    assert wait_until(lambda: not workspace.exists() and not os.path.lexists(trash), timeout=10)
    assert_intact(victim)
    # an orphan a killed host left (here: a symlink in the host's directory) at restart
    host.stop()
    orphan = sandbox_root / host.host_id / "bwrap-orphan"
    (sandbox_root / host.host_id).mkdir(exist_ok=True)
    orphan.symlink_to(victim)
    start_host(runtime="bwrap", host_id=host.host_id)
    assert not os.path.lexists(orphan)
    assert_intact(victim)


def test_remove_tree_never_follows(tmp_path, victim):
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "to-victim").symlink_to(victim)
    (tree / "top-link").symlink_to(victim)
    (tree / "a").chmod(0)
    remove_tree(tree)
    assert not tree.exists()
    top = tmp_path / "top"
    top.symlink_to(victim)
    remove_tree(top)  # a symlink given as the tree: the link goes, not its target
    assert not os.path.lexists(top)
    assert_intact(victim)


@pytest.mark.parametrize("attack", ["other-owner", "world-writable", "symlink"])
def test_an_unsafe_uid_lock_dir_is_refused(tmp_path, sandbox_root, victim, attack):
    lock_dir = tmp_path / "uids"
    if attack == "symlink":
        lock_dir.symlink_to(victim)
    else:
        lock_dir.mkdir(mode=0o700)
        if attack == "other-owner":
            os.chown(lock_dir, OTHER_UID, OTHER_UID)
        else:
            lock_dir.chmod(0o777)
    with pytest.raises(UnsafeDirectory):
        BwrapSandbox(SandboxSpec(), "j", {"root": str(sandbox_root), "uid_lock_dir": str(lock_dir)})
    assert_intact(victim)
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]  # no lock file in it
