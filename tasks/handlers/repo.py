"""Getting a repository into a sandbox at a given commit.

The worker reads the repository (a directory the operator allows, or an https URL cloned once
into a cache), packs it as a tar and writes it into the sandbox, where it is unpacked and checked
out. This works with every runtime and every node: the sandbox needs no network and no access to
the worker's disk.

A request names the source, so it gets no more than the operator allows
(:func:`sandboxes.policy.check_repo_source`): a path or ``file://`` URL only beneath
``PRORL_REPO_SOURCE_DIRS`` (after resolving links), else an https URL, which git fetches as an
unprivileged uid (``repo_clone_uid`` when the worker is root) with every protocol but https off,
its environment cleared and ``--`` before the URL.
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import os
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from prorl_celery.errors import SandboxError
from sandboxes.policy import check_repo_source

CACHE = Path(os.environ.get("PRORL_REPO_CACHE", Path.home() / ".cache" / "prorl-celery" / "repos"))
CLONE_PATH = "/usr/local/bin:/usr/bin:/bin"
CLONE_TIMEOUT_S = 1800


def repo_source(instance: dict[str, Any]) -> str:
    return instance.get("repo_source") or f"https://github.com/{instance['repo']}.git"


def local_repo(instance: dict[str, Any]) -> Path:
    """The repository on this machine: an allowed directory as it is, or the cached clone of an
    https URL. Anything else is :class:`~prorl_celery.errors.PolicyDenied`."""
    kind, source = check_repo_source(repo_source(instance))
    if kind == "dir":
        return Path(source)
    target = CACHE / hashlib.sha1(source.encode()).hexdigest()[:16]
    CACHE.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".git").exists():
            clone(source, target)
    return target


def clone_uid() -> int | None:
    """The uid a clone runs as: ``repo_clone_uid`` when this process is root, else None (we
    already are an unprivileged user)."""
    from config.settings import get_settings

    return get_settings().repo_clone_uid if os.geteuid() == 0 else None


def clone_argv(url: str, dest: str, uid: int | None, git: str = "git") -> list[str]:
    """The clone's command line (pure): https only, no other protocol (``ext::``, ``file``,
    ``ssh`` ...), the URL after ``--`` so it can never be read as an option."""
    prefix = [] if uid is None else [
        shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return [*prefix, git, "-c", "protocol.allow=never", "-c", "protocol.https.allow=always",
            "-c", "core.hooksPath=/dev/null", "clone", "--quiet", "--", url, dest]


def clone(url: str, target: Path) -> None:
    """Clone ``url`` as :func:`clone_uid` into a fresh directory that uid owns, then move it
    to ``target``; the caller holds the cache lock."""
    uid = clone_uid()
    git = shutil.which("git")
    if git is None:
        raise SandboxError("git is not installed on this worker")
    if uid is not None and shutil.which("setpriv") is None:
        raise SandboxError("refusing to clone as root: setpriv (util-linux) is missing")
    work = Path(tempfile.mkdtemp(prefix="prorl-clone-"))
    try:
        if uid is not None:
            os.chown(work, uid, uid)
        env = {"PATH": CLONE_PATH, "HOME": str(work), "LANG": "C.UTF-8", "GIT_TERMINAL_PROMPT": "0",
               "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}
        try:
            done = subprocess.run(clone_argv(url, str(work / "repo"), uid, git), cwd=work, env=env,
                                  capture_output=True, text=True, timeout=CLONE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SandboxError(f"cloning {url} took over {CLONE_TIMEOUT_S} s") from None
        if done.returncode != 0:
            raise SandboxError(f"could not clone {url} (as uid {os.geteuid() if uid is None else uid}): "
                               f"{(done.stderr or done.stdout)[-1500:]}")
        shutil.move(str(work / "repo"), str(target))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def pack(path: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(str(path), arcname=".")
    return buffer.getvalue()


def checkout_into(box, instance: dict[str, Any], dest: str) -> str:
    """Unpack the instance's repository at ``dest`` in the sandbox at ``base_commit``; returns
    the absolute path of its root inside the sandbox."""
    box.write_file(f"{dest}.tar", pack(local_repo(instance)))
    commit = shlex.quote(instance["base_commit"])
    out = box.exec(f"mkdir -p {dest} && tar -xf {dest}.tar -C {dest} && rm -f {dest}.tar && cd {dest} && "
                   f"git -c advice.detachedHead=false checkout -q -f {commit} && git clean -qfdx && pwd",
                   timeout=600)
    if out.exit_code != 0:
        raise SandboxError(f"could not check out {instance.get('repo')} at {instance['base_commit']}: "
                           f"{out.output[-1000:]}")
    root = out.output.strip().splitlines()[-1]
    box.exec("cd - >/dev/null")
    return root
