"""What a Harbor result keeps for re-grading (``prorl-celery rescore``): each step's final workspace.

The verifier of a step gets a tar of the agent's working directory (and ``harbor_carry_paths``)
built by the agent's sandbox host (:mod:`tasks.harbor.verifier`). What is kept of it is its diff
against the task's image: the members whose bytes, mode or link target differ from the image's
rootfs (or that it lacks), as a gzip-compressed tar, and the names of every file and symlink the
tree held (so that a replay deletes what the agent deleted, and what setup.sh made that the agent
removed). It goes into its own Redis hash (:func:`prorl_celery.keys.regrade_workspace`), apart
from the result, expiring after ``rescore_retention_s`` (default: the job's TTL); larger than
``rescore_max_mb`` it is not kept, and the step's ``kept.workspace`` says why.

What is not kept: anything outside the carried directories (the verifier never sees it either),
empty directories the agent removed, and a file setup.sh changed that the agent put back to the
image's bytes (it matches the image, so it is left out, and a replay keeps setup.sh's version).
A replay (:mod:`tasks.harnesses.replay`) restores each step's workspace as the agent of a new job
of the same task, whose verifier then runs as usual.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
from typing import Any

from config.settings import Settings, rescore_retention_s
from prorl_celery import keys
from prorl_celery.redisio import text

CHUNK = 1 << 20


def _same_file(info: tarfile.TarInfo, body: bytes, path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not os.path.isfile(path) or os.path.islink(path) or st.st_size != info.size or (st.st_mode & 0o7777) != info.mode:
        return False
    with open(path, "rb") as fh:
        return fh.read(info.size + 1) == body


def _in_image(rootfs: str, name: str) -> str | None:
    """The image's path for a member ``name``, or None where it would lead outside the rootfs."""
    path = os.path.join(rootfs, name)
    parent = os.path.realpath(os.path.dirname(path))
    if parent != rootfs and not parent.startswith(rootfs + os.sep):
        return None  # a symlinked directory of the image: not compared
    return path


def diff_against(tar: bytes, rootfs: str | None) -> tuple[bytes, list[str], int]:
    """(a tar of the members of ``tar`` that differ from the image at ``rootfs``, the absolute
    names of every file and symlink ``tar`` holds, how many members were left out as unchanged).
    A rootfs that is not a directory here (another node's): every member is kept."""
    root = os.path.realpath(rootfs) if rootfs and os.path.isdir(rootfs) else None
    out, names, same = io.BytesIO(), [], 0
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r") as src, tarfile.open(fileobj=out, mode="w") as dst:
        for info in src:
            name = info.name.lstrip("/")
            if info.isfile() or info.issym():
                names.append("/" + name)
            body = src.extractfile(info).read() if info.isfile() else None
            path = _in_image(root, name) if root and ".." not in name.split("/") else None
            if path is not None and (
                    (body is not None and _same_file(info, body, path))
                    or (info.issym() and os.path.islink(path) and os.readlink(path) == info.linkname)
                    or (info.isdir() and os.path.isdir(path) and not os.path.islink(path))):
                same += 1
                continue
            dst.addfile(info, io.BytesIO(body) if body is not None else None)
    return out.getvalue(), names, same


def keep(redis: Any, job_id: str, step: int, tar: bytes, rootfs: str | None, dirs: list[str],
         settings: Settings) -> dict[str, Any]:
    """Keep step ``step``'s workspace (``tar``: what its verifier got) for re-grading; what was
    kept, for the step's record (``kept.workspace``: true, or why not)."""
    retention = rescore_retention_s(settings)
    if retention <= 0:
        return {"workspace": "no: rescore_retention_s is 0"}
    changed, names, same = diff_against(tar, rootfs)
    packed = gzip.compress(changed, 6)
    meta = gzip.compress(json.dumps({"dirs": dirs, "names": names}).encode(), 6)
    size, cap = len(packed) + len(meta), settings.rescore_max_mb << 20
    if size > cap:
        return {"workspace": f"no: the diff is {size} bytes compressed, over rescore_max_mb={settings.rescore_max_mb}"}
    key = keys.regrade_workspace(job_id)
    with redis.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping={f"{step}.tar.gz": packed, f"{step}.json.gz": meta})
        pipe.expire(key, retention)
        pipe.execute()
    return {"workspace": True, "bytes": size, "files": len(names), "unchanged": same}


def load(redis: Any, job_id: str) -> dict[int, dict[str, Any]]:
    """Each kept step's workspace: ``{step: {"tar_gz": bytes, "dirs": [...], "names": [...]}}``."""
    raw = redis.hgetall(keys.regrade_workspace(job_id))
    out: dict[int, dict[str, Any]] = {}
    for field, value in raw.items():
        field = text(field)
        step, _, kind = field.partition(".")
        entry = out.setdefault(int(step), {})
        if kind == "tar.gz":
            entry["tar_gz"] = value
        else:
            entry.update(json.loads(gzip.decompress(value)))
    return {step: entry for step, entry in sorted(out.items()) if "tar_gz" in entry and "names" in entry}
