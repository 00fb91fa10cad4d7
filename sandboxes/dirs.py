"""The operator's directory lists (``PRORL_SANDBOX_IMAGE_DIRS``, ``PRORL_REPO_SOURCE_DIRS``) and
the one test applied to them: does a path lie beneath one of them; and where a node keeps the
images it builds itself."""
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


def _cache(configured: str | None, name: str) -> Path:
    """A node cache directory: ``configured``, else a root host's in /var/cache (sandbox and
    build uids cannot enter root's home), else the user's ~/.cache."""
    if configured:
        return Path(os.path.expanduser(configured))
    return Path("/var/cache/prorl-celery") / name if os.geteuid() == 0 else \
        Path.home() / ".cache" / "prorl-celery" / name


def env_dir() -> Path:
    """Where environments built from recipes are (``env_dir``; sandboxes/runtimes/env/build.py)."""
    from config.settings import get_settings

    return _cache(get_settings().env_dir, "envs")


def image_build_dir() -> Path:
    """Where images built from Dockerfiles are (``image_build_dir``; sandboxes/runtimes/images/build.py)."""
    from config.settings import get_settings

    return _cache(get_settings().image_build_dir, "built-images")


def built_image_dirs() -> list[str]:
    """The directories of the images this node built itself (from environment recipes and from
    the Dockerfiles of tasks the operator allows): allowed as images without being listed."""
    return [str(env_dir()), str(image_build_dir())]
