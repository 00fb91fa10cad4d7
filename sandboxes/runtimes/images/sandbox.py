"""The build sandbox: one bwrap process per RUN (and per COPY/ADD, whose copier runs inside it),
whose writable root is the image being built, as fake root.

- A root host runs bwrap as ``env_build_uid`` (``setpriv``) with ``--uid 0 --gid 0``: the image's
  tree belongs to that uid during the build, so dpkg's and apt's chown-to-root work inside, and
  the builder gives the tree back to root afterwards. Another uid than 0 does not exist inside:
  a package that chowns files to a system user of its own fails to install.
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
from pathlib import Path
from typing import BinaryIO

from prorl_celery.errors import ImageBuildFailed

HOST_PY = "/dev/prorl/usr/bin/python3"
LOADER = "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
LIBS = "/usr/lib/x86_64-linux-gnu"


def _settings():
    from config.settings import get_settings

    return get_settings()


def build_uid() -> int | None:
    """The uid the build runs as on a root host; None when the host is not root."""
    return _settings().env_build_uid if os.geteuid() == 0 else None


def give(tree: Path, uid: int | None) -> None:
    """``chown -R`` (links not followed) of ``tree`` to ``uid``:``uid``; nothing when None."""
    if uid is not None:
        subprocess.run(["chown", "-R", "-P", f"{uid}:{uid}", str(tree)], check=True, capture_output=True)


def _resolv(root: Path) -> None:
    """A plain ``/etc/resolv.conf`` file in the image to bind over (a link would be followed)."""
    path = root / "etc" / "resolv.conf"
    if path.is_symlink() or not path.is_file():
        (root / "etc").mkdir(exist_ok=True)
        if path.is_symlink() or path.exists():
            path.unlink() if not path.is_dir() else shutil.rmtree(path)
        path.write_text("")


def argv_for(root: Path, command: list[str], env: dict[str, str], workdir: str, network: str,
             binds: list[tuple[str, str]], uid: int | None) -> list[str]:
    """bwrap's argv for ``command`` in the image at ``root`` (see the module doc)."""
    prefix = [] if uid is None else [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}",
                                     "--clear-groups", "--"]
    argv = [*prefix, shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--uid", "0", "--gid", "0", "--hostname", "build", "--clearenv",
            "--bind", str(root), "/", "--proc", "/proc", "--dev", "/dev"]
    if network == "node":
        argv.append("--share-net")
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


def run(argv: list[str], log: BinaryIO, deadline: float, network: str, where: str) -> int:
    """Run one bwrap ``argv``, its output appended to ``log``; its exit status. Past
    ``deadline`` it is killed with its group and :class:`ImageBuildFailed` raised."""
    info_r = block_r = block_w = None
    if network == "isolated":
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        at = argv.index("--unshare-all")
        argv = [*argv[:at], "--info-fd", str(info_w), "--block-fd", str(block_r), *argv[at:]]
        fds = (info_w, block_r)
    else:
        fds = ()
    log.flush()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, pass_fds=fds, cwd="/")
    net = None
    try:
        if network == "isolated":
            os.close(fds[0])
            os.close(fds[1])
            net = _attach(info_r, proc, where)
            os.write(block_w, b"1")
        remaining = deadline - time.monotonic()
        try:
            return proc.wait(timeout=max(0.1, remaining))
        except subprocess.TimeoutExpired:
            raise ImageBuildFailed(f"Dockerfile {where}: the build ran past its timeout") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for fd in (info_r, block_w):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if net is not None:
            net.close()


def _attach(info_r: int, proc: subprocess.Popen, where: str):
    from sandboxes.runtimes.limits import netns

    data = b""
    with os.fdopen(os.dup(info_r), "rb") as fh:
        while b"}" not in data:
            chunk = fh.read1(4096)
            if not chunk:
                break
            data += chunk
    try:
        child = json.loads(data[: data.index(b"}") + 1])["child-pid"]
    except (ValueError, KeyError):
        raise ImageBuildFailed(f"Dockerfile {where}: the build sandbox did not start (exit {proc.wait()})") from None
    try:
        return netns.attach(child)
    except OSError as exc:
        raise ImageBuildFailed(f"Dockerfile {where}: could not give the build its network: {exc}") from None
