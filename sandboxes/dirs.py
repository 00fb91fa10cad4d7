"""The operator's directory lists (``PRORL_SANDBOX_IMAGE_DIRS``, ``PRORL_REPO_SOURCE_DIRS``) and
the one test applied to them: does a path lie beneath one of them."""
from __future__ import annotations

import os
import re
from pathlib import Path


def split_dirs(value: str) -> list[str]:
    """``a:b,c`` -> ``[a, b, c]`` (empty entries dropped)."""
    return [part.strip() for part in re.split(r"[:,]", value or "") if part.strip()]


def beneath(path: str, roots: list[str], lexical: bool) -> bool:
    """True if ``path`` lies strictly beneath one of ``roots`` (a root itself is not enough);
    ``lexical``: ``..`` normalised, links not resolved (for a process on another node)."""
    norm = os.path.normpath if lexical else os.path.realpath
    target = Path(norm(path))
    return any(target != Path(norm(root)) and target.is_relative_to(norm(root)) for root in roots)
