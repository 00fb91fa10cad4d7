"""A build context: the files COPY and ADD may read (the directory minus what ``.dockerignore``
excludes), hashed for the image's key and snapshotted for the build.

``.dockerignore``: one pattern a line, ``#`` comments, a leading ``/`` ignored, ``*`` and ``?``
within one path component, ``**`` across any number of them, ``!`` re-including; the last
matching line wins, and a pattern that matches a directory matches everything beneath it.
Symbolic links are taken as links (their target text), never followed.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
from functools import lru_cache
from pathlib import Path

IGNORE_FILE = ".dockerignore"


def ignore_patterns(context: Path) -> list[tuple[bool, re.Pattern]]:
    """(re-include?, regex) for each line of the context's .dockerignore."""
    path = context / IGNORE_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip().lstrip("/"))
        out.append((negate, _regex(pattern)))
    return out


@lru_cache(maxsize=256)
def _regex(pattern: str) -> re.Pattern:
    parts, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            parts.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            parts.append(".*")
            i += 2
        elif pattern[i] == "*":
            parts.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            parts.append("[^/]")
            i += 1
        else:
            parts.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(parts) + "(?:/.*)?$")


def ignored(rel: str, patterns: list[tuple[bool, re.Pattern]]) -> bool:
    """Whether the context path ``rel`` (``a/b``) is excluded."""
    verdict = False
    for negate, regex in patterns:
        if regex.match(rel):
            verdict = not negate
    return verdict


def files(context: Path) -> list[str]:
    """Every path (relative, sorted) the build may read; directories included."""
    patterns = ignore_patterns(context)
    out = []
    for current, dirs, names in os.walk(context):
        rel_dir = os.path.relpath(current, context)
        for name in sorted(dirs + names):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if not ignored(rel, patterns):
                out.append(rel)
    return sorted(out)


def digest(context: Path, listed: list[str]) -> str:
    """sha256 over each listed path, its mode and content (a link's target)."""
    h = hashlib.sha256()
    for rel in listed:
        st = os.lstat(context / rel)
        h.update(f"{rel}\0{stat.S_IFMT(st.st_mode)}\0{stat.S_IMODE(st.st_mode):o}\0".encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(context / rel).encode())
        elif stat.S_ISREG(st.st_mode):
            with open(context / rel, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def snapshot(context: Path, listed: list[str], dest: Path) -> None:
    """The listed paths copied to ``dest`` (links as links): what the build reads."""
    dest.mkdir(parents=True)
    for rel in listed:
        src, target = context / rel, dest / rel
        st = os.lstat(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), target)
        elif stat.S_ISDIR(st.st_mode):
            target.mkdir(exist_ok=True)
            os.chmod(target, stat.S_IMODE(st.st_mode) | 0o700)
        elif stat.S_ISREG(st.st_mode):
            shutil.copy2(src, target)
