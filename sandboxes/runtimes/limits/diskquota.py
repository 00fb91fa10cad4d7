"""A size-capped filesystem per workspace: ext4 in a sparse file on a loop device.

Why not the alternatives: a tmpfs of ``size=`` holds its files in RAM, so a full workspace would
use up the sandbox's memory limit (its pages are charged to the writer's memory cgroup) and the
sandbox could not even run ``rm``; a project quota needs a filesystem with ``prjquota`` and a
kernel built with ``CONFIG_QUOTA`` (this node's is not: "The kernel was not built with
CONFIG_QUOTA"). An ext4 image costs ~4 ms of CPU at create (a sparse copy of an empty image that
mke2fs made once, without journal, lazy inode tables; the mount by ioctl), grows on the host
disk only by what is written (sparse), at most its size, and its page cache is reclaimable. Needs root and ``/dev/loop-control``; elsewhere
:func:`why_not` says why and each file is capped by RLIMIT_FSIZE instead.
"""
from __future__ import annotations

import atexit
import ctypes
import errno
import functools
import os
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

_LOOP_CTL_GET_FREE, _LOOP_CONFIGURE, _LO_FLAGS_AUTOCLEAR = 0x4C82, 0x4C0A, 4
_MS_NOSUID, _MS_NODEV, _MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 4, 2, 8
_MB = 1 << 20
MKE2FS = shutil.which("mke2fs") or "/usr/sbin/mke2fs"

_libc = ctypes.CDLL(None, use_errno=True)
_devices: dict[str, str] = {}  # mounted workspace directory -> its loop device
_templates: dict[int, str] = {}  # size in MiB -> empty ext4 image to copy
_templates_lock = threading.Lock()
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


@functools.cache
def why_not() -> str:
    """Why workspaces get no filesystem of their own here ("" when they do)."""
    from config.settings import get_settings

    if not get_settings().sandbox_cgroups:
        return "turned off (sandbox_cgroups=false)"
    if os.geteuid() != 0:
        return "the sandbox host is not root"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control"
    if not os.access(MKE2FS, os.X_OK):
        return "no mke2fs (e2fsprogs)"
    return ""


def _loop_config(fd: int) -> bytes:
    """struct loop_config: fd, block_size, loop_info64 (flags = autoclear), reserved."""
    info = struct.pack("=5Q4I64s64s32s2Q", 0, 0, 0, 0, 0, 0, 0, 0, _LO_FLAGS_AUTOCLEAR,
                       b"", b"", b"", 0, 0)
    return struct.pack("=II", fd, 0) + info + bytes(64)


def _attach(image: str) -> tuple[str, int]:
    """A free loop device backed by ``image`` and a descriptor of it: keep that open until the
    device is mounted (autoclear detaches it at the last close while unmounted)."""
    import fcntl

    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(20):
            device = f"/dev/loop{fcntl.ioctl(control, _LOOP_CTL_GET_FREE)}"
            loop = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(loop, _LOOP_CONFIGURE, _loop_config(backing))
                return device, loop
            except OSError as exc:
                os.close(loop)
                if exc.errno != errno.EBUSY:  # another host took it between the two calls
                    raise
        raise OSError(errno.EBUSY, "no free loop device")
    finally:
        os.close(control)
        os.close(backing)


def _template(size_mb: int) -> str:
    """An empty ``size_mb`` ext4 image made once per host process (mke2fs costs ~7 ms of CPU per
    sandbox; copying the ~1 MiB of metadata of a sparse image costs ~0.6 ms)."""
    with _templates_lock:
        path = _templates.get(size_mb)
        if path is None:
            from sandboxes.safedirs import private_dir

            where = private_dir(os.path.join(tempfile.gettempdir(), "prorl-ext4-templates"), 0o700)
            for stale in where.glob("*-*.img"):  # of hosts killed before their atexit ran
                pid = stale.stem.rpartition("-")[2]
                if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                    stale.unlink(missing_ok=True)
            path = str(where / f"{size_mb}-{os.getpid()}.img")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size_mb * _MB)
            finally:
                os.close(fd)
            subprocess.run([MKE2FS, "-q", "-F", "-t", "ext4", "-O", "^has_journal", "-m", "0",
                            "-E", "lazy_itable_init=1,nodiscard", path], check=True,
                           capture_output=True, timeout=60, env={"PATH": "/usr/sbin:/usr/bin"})
            _templates[size_mb] = path
            atexit.register(_unlink, path)
        return path


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _copy_sparse(src_path: str, dst: int) -> None:
    """Copy the data extents of ``src_path`` into ``dst`` (as large, its holes left holes)."""
    src = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        end, offset = os.fstat(src).st_size, 0
        os.ftruncate(dst, end)
        while offset < end:
            try:
                data = os.lseek(src, offset, os.SEEK_DATA)
            except OSError as exc:  # ENXIO: no data past offset
                if exc.errno == errno.ENXIO:
                    return
                raise
            hole = os.lseek(src, data, os.SEEK_HOLE)
            while data < hole:
                data += os.copy_file_range(src, dst, hole - data, data, data)
            offset = hole
    finally:
        os.close(src)


def mount_image(directory: Path, size_mb: int, uid: int | None) -> Path:
    """Make a ``size_mb`` ext4 image beside ``directory`` (a copy of an empty template) and
    mount it there (nosuid, nodev), its root owned by ``uid``. Returns the image's path (removed
    by :func:`unmount`)."""
    image = directory.with_name(f".{directory.name}.img")
    template = _template(size_mb)
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _copy_sparse(template, fd)
    except BaseException:
        os.close(fd)
        image.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        device, loop = _attach(str(image))
        try:
            if _libc.mount(device.encode(), bytes(directory), b"ext4", _MS_NOSUID | _MS_NODEV,
                           b"") != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mount {device}: {os.strerror(err)}", str(directory))
        finally:
            os.close(loop)
        _devices[str(directory)] = device
        if uid is not None:
            os.chown(directory, uid, uid)  # the filesystem's root, as mke2fs's root_owner did
    except BaseException:
        image.unlink(missing_ok=True)
        raise
    try:
        os.rmdir(directory / "lost+found")
    except OSError:
        pass
    return image


def device_of(directory: Path) -> str | None:
    """The loop device of the workspace filesystem mounted at ``directory`` by this process."""
    return _devices.get(str(directory))


def is_mountpoint(path: Path) -> bool:
    """Without following a symlink at ``path``."""
    try:
        st = os.lstat(path)  # a link is not a directory here: never followed
        return stat.S_ISDIR(st.st_mode) and st.st_dev != os.lstat(path.parent).st_dev
    except OSError:
        return False


def unmount(directory: Path) -> None:
    """Detach the filesystem at ``directory`` (a sandbox still running keeps its own view until it
    dies; then the loop device goes) and delete its image."""
    if is_mountpoint(directory):
        if _libc.umount2(bytes(directory), _MNT_DETACH | _UMOUNT_NOFOLLOW) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount: {os.strerror(err)}", str(directory))
    _devices.pop(str(directory), None)
    directory.with_name(f".{directory.name}.img").unlink(missing_ok=True)
