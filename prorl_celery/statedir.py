"""State directories and the secrets file: private by construction.

A state directory holds Redis's data (AOF: every job, every sandbox host's token), logs and
``secrets.env`` (the API token and the Redis URL with its password). It is created 0700 under a
umask of 077, and one that already exists is refused unless this user owns it and nobody else can
write it: a local user who pre-created it (or a symlink to elsewhere) would otherwise read or
swap what the service keeps there. Standard library only: the trainer SDK reads the secrets file.
"""
from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path

SECRETS_NAME = "secrets.env"
_HEADER = ("# prorl-celery secrets (API token, Redis URL with its password): keep this file 0600.\n"
           "# Shell syntax: `source` it, or let ProrlClient / prorl-celery status read it.\n")


class UnsafeStateDir(PermissionError):
    """A state directory that another user owns or may write: refusing to keep secrets there."""


def check_private(path: Path) -> None:
    """Raise UnsafeStateDir unless ``path`` is a real directory (no symlink), owned by this user,
    and not writable by group or others."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeStateDir(f"{path} is not a directory (a symlink is refused too)")
    if info.st_uid != os.geteuid():
        raise UnsafeStateDir(f"{path} is owned by uid {info.st_uid}, not by this user ({os.geteuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeStateDir(f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})")


def make_private_dir(path: Path) -> Path:
    """``path`` (and missing parents) created 0700; an existing one checked, then set to 0700."""
    path = Path(path)
    old = os.umask(0o077)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    finally:
        os.umask(old)
    check_private(path)
    os.chmod(path, 0o700, follow_symlinks=False)
    return path


def write_secrets(state_dir: Path, values: dict[str, str]) -> Path:
    """``<state_dir>/secrets.env``, 0600 from its creation (written aside, then renamed)."""
    path = Path(state_dir) / SECRETS_NAME
    tmp = path.with_name(f".{SECRETS_NAME}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(_HEADER + "".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items()))
    os.replace(tmp, path)
    return path


def read_secrets(state_dir: str | Path) -> dict[str, str]:
    """The KEY=VALUE pairs of ``<state_dir>/secrets.env``; {} when there is none."""
    try:
        text = (Path(state_dir) / SECRETS_NAME).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    values = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = " ".join(shlex.split(value))
    return values


def lookup(name: str, state_dir: str | Path | None = None) -> str | None:
    """``name`` from the environment, else from the secrets file of ``state_dir`` (default:
    ``$PRORL_STATE_DIR``)."""
    if os.environ.get(name):
        return os.environ[name]
    state_dir = state_dir or os.environ.get("PRORL_STATE_DIR")
    return read_secrets(state_dir).get(name) if state_dir else None
