"""The last touches of a built image, host-side, after every build process is dead: the tree
given back to root, ``COPY --chown`` applied, the mount points sandboxes bind over, and the
metadata file. Paths inside the image are walked one component at a time with ``O_NOFOLLOW``
from the root's descriptor: a link a RUN left in the image is never followed on the host."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

MOUNT_POINTS = ("proc", "dev", "tmp", "workspace", "logs", "tests", "solution", "opt/prorl-harnesses",
                "opt/prorl-tools", "run/prorl-gateway", "var/tmp", "root")
STICKY = ("tmp", "var/tmp")
METADATA = "etc/prorl-image.json"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _parent_fd(root_fd: int, rel: str, create: bool) -> tuple[int, str] | None:
    """(an fd of the directory holding ``rel``'s last component, that name); None when a
    component on the way is a link or not a directory."""
    parts = [p for p in rel.strip("/").split("/") if p not in ("", ".")]
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            if part == "..":
                return None
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = nxt
        return os.dup(fd), parts[-1]
    finally:
        os.close(fd)


def mount_points(root: Path) -> list[str]:
    """Make the empty directories and the ``/etc/resolv.conf`` file sandboxes bind over; the
    names that could not be made (a link in the way) are returned."""
    skipped = []
    root_fd = os.open(root, _DIR)
    try:
        for rel in MOUNT_POINTS:
            found = _parent_fd(root_fd, rel, create=True)
            if found is None:
                skipped.append(rel)
                continue
            fd, name = found
            try:
                try:
                    os.mkdir(name, 0o1777 if rel in STICKY else 0o755, dir_fd=fd)
                    if rel in STICKY:
                        os.chmod(name, 0o1777, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        skipped.append(rel)
            finally:
                os.close(fd)
        write(root_fd, "etc/resolv.conf", "", only_if_missing=True)
    finally:
        os.close(root_fd)
    return skipped


def write(root_fd: int, rel: str, text: str, only_if_missing: bool = False) -> None:
    """A regular file at ``rel`` holding ``text`` (a link or a file there is replaced)."""
    found = _parent_fd(root_fd, rel, create=True)
    if found is None:
        raise OSError(f"/{rel}: a link or a file is in the way")
    fd, name = found
    try:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if only_if_missing and stat.S_ISREG(st.st_mode):
                return
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
        with os.fdopen(out, "w") as fh:
            fh.write(text)
    finally:
        os.close(fd)


def strip_special(root: Path) -> int:
    """Remove device nodes, fifos and sockets (mmdebstrap's /dev among them): a sandbox gets its
    own /dev. Links are not followed. Returns how many were removed."""
    removed = 0
    root_fd = os.open(root, _DIR)
    try:
        for _top, dirs, files, fd in os.fwalk(".", dir_fd=root_fd, follow_symlinks=False):
            for name in files:
                mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode) or stat.S_ISDIR(mode)):
                    os.unlink(name, dir_fd=fd)
                    removed += 1
    finally:
        os.close(root_fd)
    return removed


def give_back(root: Path, uid: int | None, chowns: list[tuple[str, int, int]]) -> None:
    """The tree to 0:0 (on a root host), then each ``COPY --chown`` path (recursively) to its owner."""
    if uid is None:
        return
    subprocess.run(["chown", "-R", "-P", "0:0", str(root)], check=True, capture_output=True)
    root_fd = os.open(root, _DIR)
    try:
        for rel, owner, group in chowns:
            found = _parent_fd(root_fd, rel, create=False)
            if found is None:
                continue
            fd, name = found
            try:
                _chown_tree(fd, name, owner, group)
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)


def _chown_tree(dir_fd: int, name: str, uid: int, gid: int) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        sub = os.open(name, _DIR, dir_fd=dir_fd)
        try:
            for _top, dirs, files, fd in os.fwalk(".", dir_fd=sub, follow_symlinks=False):
                for entry in dirs + files:
                    os.chown(entry, uid, gid, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(sub)


def share_with_base(image: Path, base: Path) -> int:
    """Every file of ``image`` equal to the base's (path, size, mode, owner, mtime and content)
    becomes a hard link to it: an image costs the disk only what its steps changed. Both are
    read-only from here on (sandboxes mount them as a lower layer). Returns the files linked."""
    linked = 0
    image_fd = os.open(image, _DIR)
    try:
        for top, _dirs, files, fd in os.fwalk(".", dir_fd=image_fd, follow_symlinks=False):
            for name in files:
                if _same(fd, name, base / top / name):
                    tmp = f".{name}.prorl-link"
                    os.link(base / top / name, tmp, dst_dir_fd=fd, follow_symlinks=False)
                    os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
                    linked += 1
    finally:
        os.close(image_fd)
    return linked


def _same(dir_fd: int, name: str, other: Path) -> bool:
    mine = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    try:
        theirs = os.lstat(other)
    except OSError:
        return False
    if not (stat.S_ISREG(mine.st_mode) and stat.S_ISREG(theirs.st_mode)) or mine.st_ino == theirs.st_ino:
        return False
    if (mine.st_size, mine.st_mode, mine.st_uid, mine.st_gid, mine.st_mtime_ns) != \
            (theirs.st_size, theirs.st_mode, theirs.st_uid, theirs.st_gid, theirs.st_mtime_ns):
        return False
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        with os.fdopen(os.dup(fd), "rb") as mine_fh, open(other, "rb") as theirs_fh:
            while True:
                chunk = mine_fh.read(1 << 20)
                if chunk != theirs_fh.read(1 << 20):
                    return False
                if not chunk:
                    return True
    finally:
        os.close(fd)
