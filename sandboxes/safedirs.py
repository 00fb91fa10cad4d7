"""Directories the sandbox host owns, made and removed without trusting what is in them.

The sandbox root (``/tmp/prorl-sandboxes`` by default) and the uid lock directory live in shared
places such as ``/tmp``. Had another local user made them first, or planted a symlink there, a
root host would have worked inside that user's directory, or deleted and chmod-ed what the
symlink pointed at. So: :func:`private_dir` makes a directory or accepts an existing one only if
it is a real directory owned by this uid that nobody else can write, with every parent owned by
root or this uid and not writable by others (unless sticky, as ``/tmp``); and
:func:`remove_tree` deletes by descriptor, never following a symlink.

Modes: the root and the host's directory are 0711 (sandbox uids traverse to their workspace;
nobody lists or creates), each workspace 0700 owned by its sandbox uid under a random name.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from prorl_celery.errors import UnsafeDirectory

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW


def _check_parent(path: Path, st: os.stat_result) -> None:
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}: another user could replace "
                              f"what the sandbox host keeps beneath it")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")


def _check_own(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirectory(f"{path} is a symlink; refusing to use it as a sandbox directory")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not to the sandbox host "
                              f"(uid {os.geteuid()}): remove it, or set another sandbox root")
    if st.st_mode & 0o022:
        raise UnsafeDirectory(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                              f"remove it, or chmod go-w it")


def private_dir(path: str | os.PathLike, mode: int = 0o711) -> Path:
    """``path`` made (parents too) or checked: ours, a real directory, writable only by us, under
    parents nobody else can tamper with; then chmod ``mode``. Raises :class:`UnsafeDirectory`."""
    path = Path(os.path.abspath(path))
    for parent in reversed(path.parents):
        try:
            st = os.lstat(parent)
        except FileNotFoundError:
            private_dir(parent, mode)
            continue
        if stat.S_ISLNK(st.st_mode):  # e.g. /var/tmp -> /tmp on some systems: check the target
            st = os.stat(parent)
        _check_parent(parent, st)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    _check_own(path, os.lstat(path))
    fd = os.open(path, _DIR_FLAGS)
    try:
        _check_own(path, os.fstat(fd))  # the one we checked is the one we chmod
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return path


def _open_dir(name: str, dir_fd: int | None) -> int:
    """A descriptor of the real directory ``name`` (never a symlink), made searchable first when
    the sandbox left it mode 000 (chmod through the /proc link of an O_PATH descriptor, which
    names that very inode)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.chmod(f"/proc/self/fd/{fd}", 0o700)
        finally:
            os.close(fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _empty(dir_fd: int) -> None:
    with os.scandir(dir_fd) as entries:
        names = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    for name, is_dir in names:
        if not is_dir:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            continue
        try:
            sub = _open_dir(name, dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # replaced by a file or link meanwhile
                os.unlink(name, dir_fd=dir_fd)
                continue
            raise
        try:
            _empty(sub)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=dir_fd)


def remove_tree(path: str | os.PathLike) -> None:
    """Delete ``path`` and everything beneath it by descriptor: a symlink (at ``path`` or inside)
    is unlinked, never followed; unwritable directories a sandbox made are chmod-ed by inode. A
    filesystem mounted at ``path`` (a workspace image) is unmounted first."""
    from sandboxes.runtimes.limits.diskquota import unmount

    path = Path(os.path.abspath(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    unmount(path)
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fd = _open_dir(path.name, parent)
        except FileNotFoundError:
            return
        try:
            _empty(fd)
        finally:
            os.close(fd)
        os.rmdir(path.name, dir_fd=parent)
    finally:
        os.close(parent)


def host_dir(root: str | os.PathLike, host_id: str) -> Path:
    """``<root>/<host id>``, both made or checked by :func:`private_dir` (0711): what the sandbox
    host calls at start; :class:`UnsafeDirectory` is turned into a refusal to start."""
    try:
        return private_dir(private_dir(root) / host_id)
    except UnsafeDirectory as exc:
        raise SystemExit(f"sandbox host refuses to start: unsafe sandbox root: {exc}") from exc


def open_lock(path: str | os.PathLike) -> int:
    """A lock file in a private directory, opened without following a planted symlink."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
