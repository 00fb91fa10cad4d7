"""The build sandbox: one bwrap process per RUN (and per COPY/ADD, whose copier runs inside it),
whose writable root is the image being built, as fake root.

- A root host runs bwrap as ``env_build_uid`` (``setpriv``) inside a user namespace of its own
  that maps the build's uids and gids 0-65535 to host ids from ``image_build_uid_base``, with the
  capabilities a package install needs there (chown, DAC override, fowner, fsetid, setuid,
  setgid, kill, setfcap, sys_chroot, audit_write; never net_admin or sys_admin, so a RUN cannot
  undo its network policy). The image's tree belongs to the base id during the build, so dpkg,
  adduser and a postinst's ``chown redis`` work; afterwards the builder gives the whole tree to
  root (0:0). A host that is not root maps only its own uid to 0 (bwrap ``--uid 0``): a package
  that chowns files to a user of its own fails to install there.
- Helper binds live under bwrap's own ``/dev`` (a tmpfs), so they leave no mount point in the
  image; ``/proc`` and ``/dev`` are the sandbox's own, ``/tmp`` is the image's (as in Docker).
- Network (``image_build_network``): ``isolated`` gives the RUN its own network namespace, set up
  by :func:`sandboxes.runtimes.limits.netns.attach` (the sandboxes' outbound policy: no host
  loopback, host addresses or private ranges; slirp4netns; its resolver bound as
  ``/etc/resolv.conf``) before the command starts (bwrap's ``--info-fd``/``--block-fd``);
  ``node`` shares the node's namespace (``--share-net``) with the node's ``/etc/resolv.conf``;
  ``off`` or a ``RUN --network=none`` has no network at all.
- Every run is bounded by the build's deadline and killed with its process group.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from prorl_celery.errors import ImageBuildFailed
from sandboxes.runtimes.images import finish

HOST_PY = "/dev/prorl/usr/bin/python3"  # the node's Python, bound under the sandbox's own /dev
LOADER = "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
LIBS = "/usr/lib/x86_64-linux-gnu"


def _settings():
    from config.settings import get_settings

    return get_settings()


CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_SETUID", "CAP_SETGID", "CAP_KILL",
        "CAP_SETFCAP", "CAP_SYS_CHROOT", "CAP_AUDIT_WRITE")
ID_COUNT = 65536


@dataclass
class Identity:
    """Who a build runs as: ``run_as`` (setpriv; None: this process's uid), ``owner`` (the host
    id owning the image's tree during the build; None: this process's) and ``userns`` (an fd of
    the build's user namespace; None: bwrap makes a one-uid one)."""

    run_as: int | None = None
    owner: int | None = None
    userns: int | None = None

    def close(self) -> None:
        if self.userns is not None:
            os.close(self.userns)
            self.userns = None


def identity() -> Identity:
    """This build's :class:`Identity` (see the module doc); :meth:`Identity.close` it."""
    if os.geteuid() != 0:
        return Identity()
    settings = _settings()
    run_as, base = settings.env_build_uid, settings.image_build_uid_base
    return Identity(run_as=run_as, owner=base, userns=_userns(run_as, base))


def _userns(owner: int, base: int) -> int:
    """A user namespace owned by ``owner`` mapping 0-65535 to ``base``..: the fd that holds it."""
    from sandboxes.runtimes.limits.idmap import userns_fd

    try:
        return userns_fd(base, ID_COUNT, owner=owner)
    except OSError as exc:
        raise ImageBuildFailed(f"could not make the build's user namespace (unshare --user): {exc}") from None


def give(tree: Path, who: Identity) -> None:
    """``chown -R`` (links not followed) of ``tree`` to the build's owner; nothing when None."""
    if who.owner is not None:
        subprocess.run(["chown", "-R", "-P", f"{who.owner}:{who.owner}", str(tree)], check=True,
                       capture_output=True)


def _resolv(root: Path) -> None:
    """A plain ``/etc/resolv.conf`` file in the image to bind over, made without following any
    link a RUN left (:func:`finish.write`)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        finish.write(fd, "etc/resolv.conf", "", only_if_missing=True)
    except OSError as exc:
        raise ImageBuildFailed(f"the image's /etc/resolv.conf cannot be made: {exc}") from None
    finally:
        os.close(fd)


def argv_for(root: Path, command: list[str], env: dict[str, str], workdir: str, network: str,
             binds: list[tuple[str, str]], who: Identity) -> list[str]:
    """bwrap's argv for ``command`` in the image at ``root`` (see the module doc)."""
    uid = who.run_as
    prefix = [] if uid is None else [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}",
                                     "--clear-groups", "--"]
    if who.userns is None:
        users = ["--unshare-all"]
    else:
        users = ["--userns", str(who.userns), "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                 "--unshare-cgroup-try", *(arg for cap in CAPS for arg in ("--cap-add", cap))]
    argv = [*prefix, shutil.which("bwrap") or "bwrap", *users, "--die-with-parent", "--new-session",
            "--uid", "0", "--gid", "0", "--hostname", "build", "--clearenv",
            "--bind", str(root), "/", "--proc", "/proc", "--dev", "/dev"]
    if network == "node":
        argv = [arg for arg in argv if arg != "--unshare-net"] + ["--share-net"]
    if network in ("node", "isolated"):
        _resolv(root)
        argv += ["--ro-bind", _resolv_source(network), "/etc/resolv.conf"]
    for source, target in binds:
        argv += ["--ro-bind", source, target]
    for name, value in env.items():
        argv += ["--setenv", name, value]
    return argv + ["--chdir", workdir, *command]


def _resolv_source(network: str) -> str:
    if network == "isolated":
        from sandboxes.runtimes.limits import netns

        return netns.resolv_conf()
    return "/etc/resolv.conf" if os.path.exists("/etc/resolv.conf") else "/dev/null"


def popen(argv: list[str], who: Identity, stdout, stderr, fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start one bwrap ``argv`` in its own session, with the build's user namespace fd."""
    extra = (who.userns,) if who.userns is not None else ()
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True,
                            pass_fds=fds + extra, cwd="/")


def run(argv: list[str], log: BinaryIO, deadline: float, network: str, where: str, who: Identity,
        stdout: BinaryIO | None = None) -> int:
    """Run one bwrap ``argv``, its output appended to ``log`` (its stdout to ``stdout`` when
    given); its exit status. Past ``deadline`` it is killed (the sandbox's pid 1, so every
    process in it, and bwrap's own group) and :class:`ImageBuildFailed` raised."""
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe() if network == "isolated" else (None, None)
    at = argv.index("--die-with-parent")
    extra = ["--info-fd", str(info_w)] + (["--block-fd", str(block_r)] if block_r is not None else [])
    argv = [*argv[:at], *extra, *argv[at:]]
    log.flush()
    try:
        proc = popen(argv, who, stdout or log, log if stdout else subprocess.STDOUT,
                     (info_w,) + ((block_r,) if block_r is not None else ()))
    finally:
        os.close(info_w)
        if block_r is not None:
            os.close(block_r)
    net, child, watcher = None, None, None
    try:
        child = _child_pid(info_r)
        if child is not None and who.userns is not None:
            watcher = _watch(child)
        if network == "isolated":
            net = _attach(child, proc, where)
            os.write(block_w, b"1")
        try:
            return proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise ImageBuildFailed(f"Dockerfile {where}: the build ran past its timeout") from None
    finally:
        if proc.poll() is None:  # bwrap still holds its child: the pid cannot have been reused
            if child is not None:
                _kill(child)
            _kill(-proc.pid)
            proc.wait()
        if watcher is not None:
            watcher.stdin.write(b"done\n")
            watcher.stdin.close()
            watcher.wait()
        for fd in (info_r, block_w):
            if fd is not None:
                os.close(fd)
        if net is not None:
            net.close()


def _watch(child: int) -> subprocess.Popen:
    """A watcher that SIGKILLs the sandbox's pid 1 (so all of it) when this process dies
    before telling it ``done``: bwrap's ``--die-with-parent`` does not reach a sandbox that
    joined a user namespace of ours."""
    return subprocess.Popen(["/bin/sh", "-c", f'read -r said; [ "$said" = done ] || kill -9 {int(child)}'],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, cwd="/")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _child_pid(info_r: int) -> int | None:
    """The sandbox's pid 1 (host pid) from bwrap's ``--info-fd``; None when bwrap failed first."""
    data = b""
    with os.fdopen(os.dup(info_r), "rb") as fh:
        while b"}" not in data:
            chunk = fh.read1(4096)
            if not chunk:
                break
            data += chunk
    try:
        return int(json.loads(data[: data.index(b"}") + 1])["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _attach(child: int | None, proc: subprocess.Popen, where: str):
    from sandboxes.runtimes.limits import netns

    if child is None:
        raise ImageBuildFailed(f"Dockerfile {where}: the build sandbox did not start (exit {proc.wait()})")
    try:
        return netns.attach(child)
    except OSError as exc:
        raise ImageBuildFailed(f"Dockerfile {where}: could not give the build its network: {exc}") from None
