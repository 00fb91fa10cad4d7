"""A writable root for an image-rooted sandbox: an overlayfs whose lower layer is the image,
id-mapped so that its root-owned files belong to the sandbox's own host uid.

A root sandbox host starts each sandbox as a leased uid X that bwrap maps to uid 0 inside
(:mod:`sandboxes.runtimes.limits.uids`). The image's files belong to host uid 0, so the sandbox's
"root" could not write them. Here the image directory is cloned as a detached mount
(``open_tree``), id-mapped through a user namespace whose map is ``0 X 1`` (``mount_setattr
MOUNT_ATTR_IDMAP``: on-disk uid 0 shows as X), and made the lower layer of an overlayfs
(``fsopen``/``fsconfig lowerdir+`` by descriptor/``fsmount``) whose upper and work directories
belong to X and live in the sandbox's own directory (on its size-capped workspace filesystem
where the node gives one, so what the root writes counts against ``disk_mb``). The image on
disk never changes; two sandboxes of one image each have their own upper layer.

The overlay is never attached to any mount table the host shares: the host holds it as a
descriptor, and each start of the sandbox's shell binds it (``mount --bind /proc/self/fd/N``)
at ``<box>/root`` in a private mount namespace of the sandbox's own (:func:`bind_argv`), where
bwrap takes it as ``/``. When the sandbox's processes are gone and the host closed the
descriptor, the kernel drops the mounts; a host that dies leaves none behind (its descriptors
close with it), only the directories, which the reaping of its workspace root removes.

Files of the image owned by other uids than 0 show as the overflow uid (nobody): the sandbox has
one uid. Needs root (id-mapped mounts are made in the initial user namespace) and Linux >= 6.13
(overlayfs layers given by descriptor); :func:`why_not` says why not elsewhere.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import time

from prorl_celery.errors import SandboxError

_SYS_OPEN_TREE, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT, _SYS_MOUNT_SETATTR = 428, 430, 431, 432, 442
_OPEN_TREE_CLONE, _AT_RECURSIVE, _AT_EMPTY_PATH, _AT_FDCWD = 1, 0x8000, 0x1000, -100
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV, _MOUNT_ATTR_IDMAP = 0x1, 0x2, 0x4, 0x100000
_FSCONFIG_SET_STRING, _FSCONFIG_SET_FD, _FSCONFIG_CMD_CREATE = 1, 5, 6
_FSOPEN_CLOEXEC = _FSMOUNT_CLOEXEC = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"
MOUNT = shutil.which("mount") or "/usr/bin/mount"
BASH = shutil.which("bash") or "/bin/bash"


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


@functools.cache
def why_not() -> str:
    """Why image roots cannot be writable on this host ("" when they can)."""
    if os.geteuid() != 0:
        return ("the sandbox host is not root: an id-mapped image layer (the image's root-owned "
                "files shown as the sandbox's own uid) needs root in the initial user namespace")
    release = os.uname().release.split("-")[0].split(".")
    try:
        if tuple(int(part) for part in release[:2]) < (6, 13):
            return f"Linux {os.uname().release} is older than 6.13 (overlayfs layers by descriptor)"
    except ValueError:
        pass
    for tool in (UNSHARE, MOUNT, BASH):
        if not os.access(tool, os.X_OK):
            return f"{tool} is missing"
    return ""


def userns_fd(uid: int, count: int = 1, owner: int | None = None) -> int:
    """A descriptor of a new user namespace whose uid and gid maps are ``0 uid count`` (the
    namespace lives as long as the descriptor: the process that made it is gone when this
    returns); ``owner``: the uid that creates it, and so owns it (a root host's default: root)."""
    as_owner = [SETPRIV, f"--reuid={owner}", f"--regid={owner}", "--clear-groups", "--"] if owner is not None else []
    proc = subprocess.Popen([*as_owner, UNSHARE, "--user", "--", "cat"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                            start_new_session=True)
    try:
        own = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{proc.pid}/ns/user") == own:  # until unshare has exec'd cat
            if proc.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"unshare --user did not start (exit {proc.returncode})")
            time.sleep(0.0005)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{proc.pid}/{name}", "w") as fh:
                fh.write(f"0 {uid} {count}\n")
        return os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait()


def idmapped_tree(path: str, uid: int, ns: int | None = None) -> int:
    """A detached, read-only, id-mapped clone of the directory tree at ``path`` (its uid and gid 0
    shown as ``uid``), as a descriptor; ``ns``: a user namespace of :func:`userns_fd` to map
    through (default: a new one)."""
    tree = _check(_libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(path),
                                _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE), "open_tree")
    try:
        own = ns is None
        ns = userns_fd(uid) if own else ns
        try:
            attr = _MountAttr(_MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID
                              | _MOUNT_ATTR_NODEV, 0, 0, ns)
            _check(_libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH | _AT_RECURSIVE,
                                 ctypes.byref(attr), ctypes.sizeof(attr)), "mount_setattr (idmap)")
        finally:
            if own:
                os.close(ns)
    except BaseException:
        os.close(tree)
        raise
    return tree


def overlay(lowers: list[int], upper: str, work: str) -> int:
    """A detached overlayfs (nosuid, nodev) of the trees ``lowers`` (descriptors, topmost first)
    under the directories ``upper`` and ``work``, as a descriptor."""
    fs = _check(_libc.syscall(_SYS_FSOPEN, b"overlay", _FSOPEN_CLOEXEC), "fsopen overlay")
    try:
        for lower in lowers:
            _check(_libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_SET_FD, b"lowerdir+", None, lower),
                   "overlay lowerdir+")
        for key, value in (("upperdir", upper), ("workdir", work)):
            _check(_libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_SET_STRING, key.encode(),
                                 os.fsencode(value), 0), f"overlay {key}")
        _check(_libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0), "overlay create")
        return _check(_libc.syscall(_SYS_FSMOUNT, fs, _FSMOUNT_CLOEXEC,
                                    _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV), "fsmount overlay")
    finally:
        os.close(fs)


def writable_root(image: str, upper: str, work: str, uid: int, layers: list[str] | tuple = ()) -> int:
    """The overlay of ``image`` (id-mapped to ``uid``) under ``upper``/``work``, as a descriptor
    the caller closes; ``layers``: root-owned directories (frozen layers,
    :mod:`sandboxes.runtimes.layers`) stacked read-only above the image, topmost first, id-mapped
    as it is. :class:`SandboxError` saying why when it cannot be made here."""
    why = why_not()
    if why:
        raise SandboxError(f"writable_root cannot be given here: {why}")
    lowers: list[int] = []
    try:
        ns = userns_fd(uid)
        try:
            for path in [*layers, image]:
                lowers.append(idmapped_tree(path, uid, ns))
        finally:
            os.close(ns)
    except OSError as exc:
        for fd in lowers:
            os.close(fd)
        raise SandboxError(f"writable_root: could not id-map the image {image!r} or its layers "
                           f"(its filesystem may not support id-mapped mounts): {exc}") from exc
    try:
        return overlay(lowers, upper, work)
    except OSError as exc:
        raise SandboxError(f"writable_root: could not make the overlay of {image!r}: {exc}") from exc
    finally:
        for fd in lowers:
            os.close(fd)


def bind_argv(argv: list[str], root_fd: int, mountpoint: str) -> list[str]:
    """``argv`` started in a private mount namespace of its own in which the overlay ``root_fd``
    (inherited: pass it to the child) is bound at ``mountpoint``, the descriptor then closed.
    ``mount --no-canonicalize``: a canonicalised ``/proc/self/fd/N`` of a detached mount reads
    ``/``, and binding that would bind the host's root (bwrap's own --bind-fd does exactly that,
    and refuses afterwards)."""
    fd = int(root_fd)
    script = (f'{MOUNT} -n --no-canonicalize --bind "/proc/self/fd/{fd}" "$1" || exit 124; '
              f'exec {fd}<&-; shift; exec "$@"')
    return [UNSHARE, "--mount", "--propagation", "private", "--", BASH, "--norc", "--noprofile",
            "-c", script, "bash", mountpoint, *argv]
