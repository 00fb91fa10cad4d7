"""Moving a task's folders into a sandbox and reading what comes back, from the host's side.

A folder goes in as a tar this process builds (regular files, directories and symlinks stored as
links, names relative) written into the sandbox's workspace and unpacked by the sandbox's own
``tar`` where it belongs. What comes back (the agent's files, artifacts) comes as a tar the
sandbox host built from the sandbox's root (``export_tree``), never one a tool inside made, and is
unpacked here only into memory, member by member, within caps.
"""
from __future__ import annotations

import base64
import hashlib
import io
import os
import shlex
import tarfile
from pathlib import Path
from typing import Any

UPLOAD = ".prorl-upload.tar"
TEXT_LIMIT = 64 * 1024


def _q(text: str) -> str:
    return shlex.quote(text)


def tar_of(dirs: list[Path]) -> bytes:
    """One tar of ``dirs`` merged (a later directory's file replaces an earlier one's)."""
    members: dict[str, Path] = {}
    for top in dirs:
        for base, subdirs, files in os.walk(top):
            subdirs.sort()
            for name in sorted(subdirs + files):
                path = Path(base) / name
                members[str(path.relative_to(top))] = path
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in sorted(members):
            info = tar.gettarinfo(str(members[name]), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if info.isfile():
                with open(members[name], "rb") as f:
                    tar.addfile(info, f)
            elif info.isdir() or info.issym():
                tar.addfile(info)
    return buf.getvalue()


def mount_of(box: Any) -> str:
    """Where the sandbox's workspace is, inside it."""
    try:
        return str(box.info().get("mount") or "/workspace")
    except Exception:  # noqa: BLE001 - an older host: the runtimes' default
        return "/workspace"


def put_tar(box: Any, data: bytes, dest: str, *, mount: str, timeout: float = 120) -> None:
    """Unpack the tar ``data`` at ``dest`` in the sandbox (made if missing), as the sandbox's root."""
    box.write_file(UPLOAD, data)
    path = f"{mount.rstrip('/')}/{UPLOAD}"
    out = box.exec(f"mkdir -p {_q(dest)} && tar --no-same-owner -xf {_q(path)} -C {_q(dest)}; rc=$?; "
                   f"rm -f {_q(path)}; exit $rc", timeout=timeout)
    if out.exit_code != 0:
        raise RuntimeError(f"could not unpack files at {dest} in the sandbox: {out.output[-500:]}")


def put_dirs(box: Any, dirs: list[Path], dest: str, *, mount: str) -> None:
    if dirs:
        put_tar(box, tar_of(dirs), dest, mount=mount)


def members(data: bytes, limit: int) -> dict[str, dict[str, Any]]:
    """The regular files of the tar ``data`` (as the host built it), each as ``{size, sha256}``
    and its ``text`` (or ``base64``) when small: for the result's artifacts."""
    out: dict[str, dict[str, Any]] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for info in tar:
            if not info.isfile() or len(out) >= 256:
                continue
            body = tar.extractfile(info).read(limit + 1) if info.size <= limit else b""
            entry: dict[str, Any] = {"size": info.size}
            if body and len(body) <= limit:
                entry["sha256"] = hashlib.sha256(body).hexdigest()
                try:
                    entry["text"] = body.decode()
                except UnicodeDecodeError:
                    entry["base64"] = base64.b64encode(body).decode()
            out[info.name] = entry
    return out
