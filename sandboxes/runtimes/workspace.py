"""A sandbox's writable directory, handled from the host without ever leaving it.

The sandbox can put symlinks, FIFOs and odd modes in its workspace; the host (often root) reads
and writes there for the file calls. Every path is resolved relative to a descriptor
of the workspace with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`` (Linux >= 5.6), or, on
older kernels, one ``O_NOFOLLOW`` component at a time, so no ``..``, absolute symlink or symlink
race reaches outside it. Only regular files are read (a FIFO cannot block the host), and no
more than ``sandbox_read_max_mb`` of one (:class:`FileTooLarge`, HTTP 413, past that). Where the
host is root a workspace is a size-capped filesystem of its own (:mod:`sandboxes.runtimes.limits.diskquota`);
it is removed by descriptor, never following a symlink (:mod:`sandboxes.safedirs`).
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat
from pathlib import Path
from collections.abc import Iterator
from typing import IO

from prorl_celery.errors import FileTooLarge
from sandboxes.runtimes.limits import diskquota
from sandboxes.protocol import StatResult
from sandboxes.safedirs import remove_tree

_SYS_OPENAT2 = 437  # the same number on every architecture (new-style syscall table)
_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x02, 0x04, 0x08
_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_have_openat2 = True


def read_cap_bytes() -> int:
    from config.settings import get_settings

    return get_settings().sandbox_read_max_mb * (1 << 20)


def quota_why_not() -> str:
    return diskquota.why_not()


def quota_supported() -> bool:
    return not diskquota.why_not()


def escape_error(path: str) -> PermissionError:
    return PermissionError(errno.EACCES, "path is outside the sandbox workspace", path)


def open_beneath(dir_fd: int, rel: str, flags: int, mode: int = 0o644,
                 no_symlinks: bool = False) -> int:
    """``os.open(rel, flags, dir_fd=dir_fd)`` that cannot resolve to anything outside ``dir_fd``;
    with ``no_symlinks``, a symlink anywhere on the way is refused too (PermissionError)."""
    global _have_openat2
    if _have_openat2:
        resolve = _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS | (_RESOLVE_NO_SYMLINKS if no_symlinks else 0)
        how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, resolve)
        fd = _libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(rel), ctypes.byref(how),
                           ctypes.sizeof(how))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EPERM):  # EPERM: a seccomp filter that forbids it
            if err == errno.EXDEV or (no_symlinks and err == errno.ELOOP):
                raise escape_error(rel)
            raise OSError(err, os.strerror(err), rel)
        _have_openat2 = False
    parts = rel.split("/")
    fd = os.dup(dir_fd)
    try:  # no openat2: refuse every symlink on the way
        for part in parts[:-1]:
            new = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = new
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise escape_error(rel) from exc
        raise
    finally:
        os.close(fd)


def split(path: str) -> list[str]:
    """Components of a relative path; ``..`` is refused rather than interpreted."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise escape_error(path)
    return parts


class Workspace:
    """The host directory ``host_dir``, mounted at ``mount`` inside the sandbox.

    Paths given to it are relative to the workspace, or absolute inside ``mount``. Files it
    creates belong to ``uid``/``gid`` when given (the sandbox's own user on the host).
    ``files``: a subdirectory of ``host_dir`` that is the workspace proper (what ``mount``
    shows), where ``host_dir`` (its filesystem, what retire and remove act on) holds more of
    the sandbox than the workspace (a writable root's layers)."""

    def __init__(self, host_dir: str | Path, mount: str, uid: int | None = None,
                 gid: int | None = None, files: str | None = None):
        self.host_dir = Path(host_dir)
        self.mount = mount.rstrip("/") or "/"
        self.uid, self.gid = uid, gid
        self.files = files

    @property
    def files_dir(self) -> Path:
        """The host directory the sandbox sees at ``mount``."""
        return self.host_dir / self.files if self.files else self.host_dir

    def relative(self, path: str) -> list[str]:
        if path.startswith("/"):
            if path != self.mount and not path.startswith(self.mount.rstrip("/") + "/"):
                raise escape_error(path)
            path = path[len(self.mount):]
        return split(path)

    def _root_fd(self) -> int:
        return os.open(self.files_dir, _DIR_FLAGS | (os.O_NOFOLLOW if self.files else 0))

    def _chown(self, fd: int) -> None:
        if self.uid is not None:
            os.fchown(fd, self.uid, self.gid if self.gid is not None else self.uid)

    def _dir(self, root: int, parts: list[str], create: bool) -> int:
        """A descriptor of the directory ``parts`` (made when ``create``), beneath ``root``."""
        if not parts:
            return os.dup(root)
        try:
            return open_beneath(root, "/".join(parts), _DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
        parent = self._dir(root, parts[:-1], create=True)
        try:
            try:
                os.mkdir(parts[-1], 0o755, dir_fd=parent)
                fd = open_beneath(parent, parts[-1], _DIR_FLAGS)
                self._chown(fd)
                return fd
            except FileExistsError:
                return open_beneath(root, "/".join(parts), _DIR_FLAGS)
        finally:
            os.close(parent)

    def mount_quota(self, size_mb: int) -> None:
        """Give the (still empty) workspace a filesystem of ``size_mb`` of its own."""
        diskquota.mount_image(self.host_dir, size_mb, self.uid)

    def makedirs(self, path: str) -> None:
        root = self._root_fd()
        try:
            os.close(self._dir(root, self.relative(path), create=True))
        finally:
            os.close(root)

    # -- single files -----------------------------------------------------------------------
    def open_read(self, path: str, max_bytes: int | None = None) -> IO[bytes]:
        """The regular file ``path`` opened for reading; :class:`FileTooLarge` when it is larger
        than ``max_bytes`` (default: ``sandbox_read_max_mb``). Read it with :func:`read_capped`."""
        parts = self.relative(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        root = self._root_fd()
        try:
            fd = open_beneath(root, "/".join(parts), os.O_RDONLY | os.O_NONBLOCK)
        finally:
            os.close(root)
        fh = os.fdopen(fd, "rb")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            _check_size(path, st.st_size, max_bytes or read_cap_bytes())
        except BaseException:
            fh.close()
            raise
        return fh

    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes:
        cap = max_bytes or read_cap_bytes()
        with self.open_read(path, cap) as fh:
            data = fh.read(cap + 1)  # the file may have grown since fstat
        _check_size(path, len(data), cap)
        return data

    def stat(self, path: str) -> StatResult:
        """What is at ``path``; its last component is not followed (a link says ``link``)."""
        parts = self.relative(path)
        root = self._root_fd()
        try:
            parent = self._dir(root, parts[:-1], create=False)
        finally:
            os.close(root)
        try:
            st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False) if parts else os.fstat(parent)
        finally:
            os.close(parent)
        return StatResult.of(path, st)

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        parts = self.relative(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        root = self._root_fd()
        try:
            parent = self._dir(root, parts[:-1], create=True)
        finally:
            os.close(root)
        try:
            fd = open_beneath(parent, parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC |
                              os.O_NONBLOCK, mode)
        finally:
            os.close(parent)
        with os.fdopen(fd, "wb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            self._chown(fd)
            fh.write(data)

    def retire(self) -> None:
        """Move the workspace aside (one rename) so its path is gone at once; :meth:`remove`
        deletes it later. Safe while the sandbox still has it mounted. A workspace filesystem
        is detached first (a mountpoint cannot be renamed)."""
        try:
            diskquota.unmount(self.host_dir)
        except OSError:
            pass
        trash = self.host_dir.with_name(f".trash-{self.host_dir.name}")
        try:
            os.rename(self.host_dir, trash)
            self.host_dir = trash
        except OSError:
            pass

    def remove(self) -> None:
        remove_tree(self.host_dir)


def stream_capped(fh: IO[bytes], cap: int | None = None) -> Iterator[bytes]:
    """Chunks of an opened file, closed at the end; no more than ``cap`` bytes in all (a file
    that grew after :meth:`Workspace.open_read` checked it is cut there)."""
    left = cap or read_cap_bytes()
    with fh:
        while left > 0 and (chunk := fh.read(min(_CHUNK, left))):
            left -= len(chunk)
            yield chunk


def _check_size(path: str, size: int, cap: int) -> None:
    if size > cap:
        raise FileTooLarge(f"{path} is larger than {cap >> 20} MiB ({size} bytes or more): "
                           f"too large to read whole; read a part with a command instead")


class WorkspaceFiles:
    """The file half of :class:`~sandboxes.base.Sandbox` for runtimes whose files live in a
    :class:`Workspace` on the host (``self.workspace``)."""

    workspace: Workspace

    def read_file(self, path: str) -> bytes:
        return self.workspace.read_bytes(path)

    def open_file(self, path: str) -> IO[bytes]:
        """For the host's read route: the file, size-checked, to be streamed."""
        return self.workspace.open_read(path)

    def write_file(self, path: str, data: bytes) -> None:
        self.workspace.write_bytes(path, data)

    def stat(self, path: str) -> StatResult:
        return self.workspace.stat(path)
