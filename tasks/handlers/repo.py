"""Getting a repository into a sandbox at a given commit.

The worker reads the repository (a local path, or a git URL cloned once into a cache), packs it
as a tar and writes it into the sandbox, where it is unpacked and checked out. This works with
every runtime and every node: the sandbox needs no network and no access to the worker's disk.
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import os
import shlex
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from prorl_celery.errors import SandboxError

CACHE = Path(os.environ.get("PRORL_REPO_CACHE", Path.home() / ".cache" / "prorl-celery" / "repos"))


def local_repo(instance: dict[str, Any]) -> Path:
    source = instance.get("repo_source") or f"https://github.com/{instance['repo']}.git"
    if os.path.isdir(source):
        return Path(source)
    target = CACHE / hashlib.sha1(source.encode()).hexdigest()[:16]
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".git").exists():
            subprocess.run(["git", "clone", "--quiet", source, str(target)], check=True, timeout=1800,
                           capture_output=True)
    return target


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
