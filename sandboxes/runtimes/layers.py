"""Frozen layers: a writable-root sandbox's changes kept read-only, for other sandboxes of the
same image to start from (a Harbor group's "init once, fork n": :mod:`tasks.harbor.fork`).

Once every process of a prepared sandbox is dead, its overlay's upper directory (each change it
made to the image's root, deletions as overlayfs whiteouts) is copied whole, xattrs kept, into
the node's layer directory (``sandbox_layer_dir``; default ``<image build dir>-layers``, beside
the images), the sandbox's uid made root's::

    <layers>/<name>/tree         the changes: a lower layer above the image (root-owned, 0755 at most)
    <layers>/<name>/layer.json   who froze it (group, job), when, its files and bytes
    <layers>/<name>/lock         a shared flock held by every sandbox it is a layer of

A layer is made in a hidden directory and renamed into place whole, so a reader sees none or all
of it; it is never written again. A sandbox started on it gets it as one more read-only,
id-mapped lower layer (:func:`sandboxes.runtimes.limits.idmap.writable_root`), so its own
writes go to its own upper directory: no sandbox sees another's writes, none changes the layer.
A layer is removed (renamed aside, then deleted) only while no sandbox holds its lock; the beat
sweep asks each host to remove those whose group ended or whose age passed the TTL
(:mod:`tasks.sweep.layers`). Requests name layers, never paths: a name is resolved here,
beneath the operator's directory.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from prorl_celery.errors import SandboxError
from sandboxes.base import LAYER_NAME
from sandboxes.protocol import LayerEntry

NAME = LAYER_NAME
TREE, META, LOCK = "tree", "layer.json", "lock"
CP = shutil.which("cp") or "/usr/bin/cp"


def layer_dir() -> Path:
    """``sandbox_layer_dir``, or ``<image build dir>-layers`` beside the images this node builds
    (not beneath them: what is there may be named as an image)."""
    from config.settings import get_settings
    from sandboxes.dirs import image_build_dir

    configured = get_settings().sandbox_layer_dir
    return Path(os.path.expanduser(configured)) if configured else \
        image_build_dir().with_name(image_build_dir().name + "-layers")


def check_name(name: str) -> str:
    if not NAME.match(name or ""):
        raise SandboxError(f"layer name {name!r} is not one this service makes ({NAME.pattern})")
    return name


def _root() -> Path:
    root = layer_dir()
    root.mkdir(parents=True, exist_ok=True)
    if os.stat(root).st_uid == os.geteuid():
        root.chmod(0o700)  # only the host reaches layers; sandboxes get them as mounts
    return root


def _own(tree: Path, uid: int) -> tuple[int, int]:
    """Every entry of ``tree`` owned by ``uid`` given to root (as the image's own files are),
    set-id bits dropped; returns (entries, bytes)."""
    files = size = 0
    for top, dirs, names in os.walk(tree):
        links = [d for d in dirs if os.path.islink(os.path.join(top, d))]  # not walked into
        for entry in [top, *(os.path.join(top, n) for n in [*names, *links])]:
            st = os.lstat(entry)
            if st.st_uid == uid or st.st_gid == uid:
                os.lchown(entry, 0 if st.st_uid == uid else -1, 0 if st.st_gid == uid else -1)
            if st.st_mode & 0o6000 and not os.path.islink(entry):
                os.chmod(entry, st.st_mode & 0o1777)
            if entry != str(tree):
                files, size = files + 1, size + (st.st_size if not os.path.isdir(entry) else 0)
    return files, size


def freeze(upper: Path, uid: int, name: str, group_id: str | None, job_id: str | None,
           timeout: float) -> LayerEntry:
    """``upper`` (a dead sandbox's overlay upper directory, its files the sandbox uid ``uid``'s)
    copied into the layer ``name``; an existing layer of that name is kept and returned."""
    root = _root() / check_name(name)
    if (root / META).is_file():
        return _entry(root)
    tmp = root.parent / f".new-{name}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700)
    try:
        out = subprocess.run([CP, "-a", "--reflink=auto", "--", str(upper), str(tmp / TREE)],
                             capture_output=True, text=True, timeout=timeout, env={"PATH": "/usr/bin:/bin"})
        if out.returncode != 0:
            raise SandboxError(f"freezing the sandbox's root failed: {out.stderr[-500:]}")
        files, size = _own(tmp / TREE, uid)
        meta = LayerEntry(name=name, created_at=time.time(), files=files, bytes=size,
                          group_id=group_id, job_id=job_id)
        (tmp / META).write_text(meta.model_dump_json(exclude={"in_use"}))
        (tmp / LOCK).touch(0o600)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, root)
        except OSError:  # another freeze of the same name was first: its layer stands
            shutil.rmtree(tmp, ignore_errors=True)
        return _entry(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _entry(path: Path, in_use: bool = False) -> LayerEntry:
    data = json.loads((path / META).read_text())
    return LayerEntry.model_validate({**data, "in_use": in_use})


@dataclass
class LayerHold:
    """Layers a sandbox runs on, held (never removed meanwhile) until :meth:`release`."""

    names: list[str]
    paths: list[str]
    _fds: list[int] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # drops the shared flock
        self._fds = []


def hold(names: list[str]) -> LayerHold:
    """The layers ``names`` (topmost first) found whole and held; :class:`SandboxError` naming
    one that is missing or being removed."""
    held = LayerHold(list(names), [])
    try:
        for name in names:
            path = layer_dir() / check_name(name)
            try:
                fd = os.open(path / LOCK, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                raise SandboxError(f"no layer {name!r} on this node (removed, or frozen on another)") from None
            held._fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SandboxError(f"layer {name!r} is being removed") from None
            tree = path / TREE
            st = os.lstat(tree)
            if not os.path.isdir(tree) or os.path.islink(tree) or st.st_uid != 0 and os.geteuid() == 0:
                raise SandboxError(f"layer {name!r} is not a root-owned directory")
            held.paths.append(str(tree))
        return held
    except BaseException:
        held.release()
        raise


def list_layers() -> list[LayerEntry]:
    """The node's layers (those whose lock a sandbox holds: ``in_use``)."""
    root = layer_dir()
    out = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if not NAME.match(path.name) or not (path / META).is_file():
            continue
        out.append(_entry(path, in_use=_busy(path)))
    return out


def _busy(path: Path) -> bool:
    fd = os.open(path / LOCK, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove(names: list[str]) -> list[str]:
    """Remove the layers ``names`` that no sandbox holds; returns those removed."""
    removed = []
    for name in names:
        path = layer_dir() / check_name(name)
        try:
            fd = os.open(path / LOCK, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            gone = path.parent / f".gone-{name}-{secrets.token_hex(4)}"
            os.rename(path, gone)  # no new sandbox finds it from here on
        except BlockingIOError:
            continue
        finally:
            os.close(fd)
        shutil.rmtree(gone, ignore_errors=True)
        removed.append(name)
    return removed


def remove_debris(older_than_s: float = 3600.0) -> None:
    """Half-made or half-removed layers a killed host left (hidden directories)."""
    root = layer_dir()
    now = time.time()
    for path in root.iterdir() if root.is_dir() else []:
        if path.name.startswith((".new-", ".gone-")) and now - path.lstat().st_mtime > older_than_s:
            shutil.rmtree(path, ignore_errors=True)
