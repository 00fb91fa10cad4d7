"""Directory trees as uncompressed tar streams, written without following or leaving anything.

Used on both sides of the sandbox host protocol: the host archives a workspace for
``copy_out`` (walking it by descriptor, symlinks stored as links), and a worker archives a local
repository for ``copy_in`` (never hard links) and unpacks what a sandbox sent with tarfile's
``data`` filter.
"""
from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Iterator
from typing import IO

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def file_info(name: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode, info.mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    else:
        info.size = st.st_size
    return info


def add_tree(tar: tarfile.TarFile, dir_fd: int, prefix: str) -> None:
    """Add the contents of the directory ``dir_fd`` under ``prefix``, never leaving it."""
    for entry in _scan(dir_fd):
        name = f"{prefix}{entry.name}"
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            info = file_info(name, st)
            info.type, info.size = tarfile.SYMTYPE, 0
            info.linkname = os.readlink(entry.name, dir_fd=dir_fd)
            tar.addfile(info)
        elif stat.S_ISDIR(st.st_mode):
            sub = os.open(entry.name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
            try:
                tar.addfile(file_info(name, st))
                add_tree(tar, sub, name + "/")
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=dir_fd)
            with os.fdopen(fd, "rb") as fh:
                tar.addfile(file_info(name, os.fstat(fd)), fh)


def _scan(dir_fd: int) -> Iterator[os.DirEntry]:
    with os.scandir(dir_fd) as entries:
        yield from sorted(entries, key=lambda entry: entry.name)


def write_tree_archive(src_dir: str | os.PathLike, out: IO[bytes]) -> None:
    """A tar (no hard links, symlinks kept as links) of the contents of a local directory."""
    fd = os.open(src_dir, _DIR_FLAGS)
    try:
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            add_tree(tar, fd, "")
    finally:
        os.close(fd)


def _data_only(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    try:
        return tarfile.data_filter(member, dest)
    except tarfile.FilterError:
        return None  # e.g. a symlink pointing outside: left out, the rest still arrives


def extract_archive(archive: IO[bytes], dest_dir: str | os.PathLike) -> None:
    """Unpack a tar from a sandbox into a local directory with tarfile's ``data`` filter
    (nothing outside ``dest_dir``, no devices, no set-id bits; offending members are skipped)."""
    os.makedirs(dest_dir, exist_ok=True)
    with tarfile.open(fileobj=archive, mode="r|") as tar:
        tar.extractall(dest_dir, filter=_data_only)
