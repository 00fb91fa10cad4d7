"""Reading a sandbox's trees from the host's side: a tar of some of its paths
(:meth:`~sandboxes.base.Sandbox.export_tree`) and files read once it is dead
(:meth:`~sandboxes.base.Sandbox.finish`).

A sandbox path is taken beneath one of its *bases*: a host directory (or a descriptor of one)
that the sandbox sees at a mount point (its workspace, a writable root's ``/logs``, the root
itself). The way to a path is opened with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)``: a
symlink on the way is refused, not followed. Below it the walk goes by descriptor, each entry
``lstat``-ed and opened ``O_NOFOLLOW``: symlinks are stored as symlinks, FIFOs, sockets and
devices are skipped, a regular file is read at most to the bytes left under the cap.
"""
from __future__ import annotations

import errno
import io
import os
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager

from prorl_celery.errors import FileTooLarge
from sandboxes.runtimes.workspace import escape_error, open_beneath, split

Bases = dict[str, "str | int"]  # mount point inside -> host directory (path or descriptor)
MAX_DEPTH = 256
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_BLOCK = tarfile.BLOCKSIZE


def locate(bases: Bases, path: str, relative_to: str) -> tuple[str, list[str]]:
    """(the base's mount point, the path's components beneath it) of the sandbox path ``path``
    (a relative one: beneath ``relative_to``, the workspace); the deepest base wins. A path
    under no base is a PermissionError."""
    parts = split(path if path.startswith("/") else f"{relative_to}/{path}")
    for mount in sorted(bases, key=lambda m: len(split(m)), reverse=True):
        prefix = split(mount)
        if parts[:len(prefix)] == prefix:
            return mount, parts[len(prefix):]
    raise escape_error(path)


@contextmanager
def _opened(base: str | int, parts: list[str]) -> Iterator[int]:
    """A descriptor of the directory ``parts`` beneath ``base``, no symlink on the way."""
    root = os.dup(base) if isinstance(base, int) else os.open(base, _DIR)
    try:
        # RESOLVE_NO_SYMLINKS refuses a symlink anywhere (ELOOP); O_NOFOLLOW would say ENOTDIR
        fd = open_beneath(root, "/".join(parts) or ".", _DIR & ~os.O_NOFOLLOW, no_symlinks=True)
    finally:
        os.close(root)
    try:
        yield fd
    finally:
        os.close(fd)


class _Tar:
    """A tar in memory that refuses to grow past ``cap`` bytes."""

    def __init__(self, cap: int):
        self.cap = cap
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)

    def room(self, name: str, size: int) -> None:
        needed = self.buf.tell() + 3 * _BLOCK + len(name) + size + 2 * tarfile.RECORDSIZE
        if needed > self.cap:
            raise FileTooLarge(f"the export passes {self.cap} bytes at {name!r}")

    def add(self, name: str, st: os.stat_result, data: bytes | None = None, link: str | None = None) -> None:
        info = tarfile.TarInfo(name)
        info.mode, info.mtime, info.uid, info.gid = stat.S_IMODE(st.st_mode), int(st.st_mtime), 0, 0
        info.uname = info.gname = ""
        if link is not None:
            info.type, info.linkname = tarfile.SYMTYPE, link
        elif data is None:
            info.type = tarfile.DIRTYPE
        else:
            info.size = len(data)
        self.room(name, len(data or b"") + len(link or ""))
        self.tar.addfile(info, io.BytesIO(data) if data is not None else None)

    def close(self) -> bytes:
        self.tar.close()
        if self.buf.tell() > self.cap:
            raise FileTooLarge(f"the export passes {self.cap} bytes")
        return self.buf.getvalue()


def _read(parent: int, name: str, limit: int) -> tuple[os.stat_result, bytes] | None:
    """The regular file ``name`` of ``parent`` (not followed), at most ``limit`` bytes or
    :class:`FileTooLarge`; None when it is gone or is no regular file."""
    try:
        fd = os.open(name, _FILE, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.ENOTDIR):
            return None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if st.st_size > limit:
            raise FileTooLarge(f"{name!r} has {st.st_size} bytes, more than the {limit} left")
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise FileTooLarge(f"{name!r} grew past the {limit} bytes left")
    return st, data


def _walk(tar: _Tar, parent: int, name: str, arcname: str, depth: int) -> None:
    """Add the entry ``name`` of the directory ``parent`` (and all beneath it) as ``arcname``."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        link = os.readlink(name, dir_fd=parent) if stat.S_ISLNK(st.st_mode) else None
    except (FileNotFoundError, OSError) as exc:  # gone, or no longer a link: changed meanwhile
        if isinstance(exc, FileNotFoundError) or exc.errno == errno.EINVAL:
            return
        raise
    if link is not None:
        tar.add(arcname, st, link=link)
    elif stat.S_ISREG(st.st_mode):
        tar.room(arcname, st.st_size)
        found = _read(parent, name, tar.cap - tar.buf.tell())
        if found is not None:
            tar.add(arcname, found[0], data=found[1])
    elif stat.S_ISDIR(st.st_mode):
        if depth > MAX_DEPTH:
            raise FileTooLarge(f"{arcname!r} is more than {MAX_DEPTH} directories deep")
        try:
            fd = os.open(name, _DIR, dir_fd=parent)
        except OSError as exc:  # replaced by a link or a file meanwhile: not followed
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return
            raise
        try:
            _walk_dir(tar, fd, os.fstat(fd), arcname, depth)
        finally:
            os.close(fd)


def _walk_dir(tar: _Tar, fd: int, st: os.stat_result, arcname: str, depth: int) -> None:
    if arcname:
        tar.add(arcname, st)
    for child in sorted(os.listdir(fd)):
        _walk(tar, fd, child, f"{arcname}/{child}" if arcname else child, depth + 1)


def export_tar(bases: Bases, paths: list[str], cap: int, relative_to: str) -> bytes:
    """The tar of ``paths`` (see :meth:`~sandboxes.base.Sandbox.export_tree`): member names are
    the sandbox paths without their leading ``/``."""
    located = [(path, *locate(bases, path, relative_to)) for path in paths]
    tar = _Tar(cap)
    for path, mount, parts in located:
        arcname = "/".join(split(mount) + parts)
        try:
            with _opened(bases[mount], parts[:-1]) as parent:
                if parts:
                    _walk(tar, parent, parts[-1], arcname, 0)
                else:
                    _walk_dir(tar, parent, os.fstat(parent), arcname, 0)
        except FileNotFoundError:
            continue  # nothing there: nothing to carry
    return tar.close()


def stamps(bases: Bases, paths: list[str], relative_to: str) -> dict[str, tuple[int, int, int]]:
    """Each of ``paths`` that is there -> (mtime_ns, ctime_ns, size), read without following a
    link: what changes whenever something writes the file."""
    out = {}
    for path in paths:
        mount, parts = locate(bases, path, relative_to)
        if not parts:
            continue
        try:
            with _opened(bases[mount], parts[:-1]) as parent:
                st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        out[path] = (st.st_mtime_ns, st.st_ctime_ns, st.st_size)
    return out


def read_files(bases: Bases, paths: list[str], cap: int, relative_to: str,
               mtimes: dict[str, int] | None = None) -> dict[str, bytes | None]:
    """Each of ``paths`` -> its bytes, or None when missing or not a regular file; more than
    ``cap`` bytes in all is :class:`FileTooLarge`. Paths are checked (:func:`locate`) before any
    is read."""
    located = [(path, *locate(bases, path, relative_to)) for path in paths]
    out: dict[str, bytes | None] = {}
    left = cap
    for path, mount, parts in located:
        out[path] = None
        if not parts:
            continue
        try:
            with _opened(bases[mount], parts[:-1]) as parent:
                found = _read(parent, parts[-1], left)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue  # missing, or a symlink on the way: nothing the grader may read
        if found is not None:
            out[path] = found[1]
            if mtimes is not None:
                mtimes[path] = found[0].st_mtime_ns
            left -= len(found[1])
    return out
