"""What a bwrap sandbox's root is made of: the host's system directories or an image's, the
image's own variables, and the node's directories every root gets (the gateway's sockets, the
harnesses), bound read-only where the root can take them."""
from __future__ import annotations

import json
import os
import stat

from pydantic import BaseModel, ConfigDict, ValidationError

from prorl_celery.errors import SandboxError
from sandboxes.base import SandboxSpec, gateway_dir

HOST_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
IMAGE_META = "etc/prorl-image.json"  # an image builder's record of the image's ENV and WORKDIR
_NOT_FROM_IMAGE = {"proc", "dev", "tmp", "sys", "workspace"}
_IMAGE_ENV_KEPT = ("HOME", "TMPDIR", "HOSTNAME", "USER", "LOGNAME", "SHELL")
_META_MAX = 256 * 1024


class ImageMeta(BaseModel):
    """``etc/prorl-image.json`` of a built image. Unknown keys are ignored: the builder is another
    component and may record more."""

    model_config = ConfigDict(extra="ignore")

    env: dict[str, str] = {}
    workdir: str | None = None


def root_entries(image: str | None, host_paths: list[str]) -> list[tuple[str, str | None]]:
    """(path in the sandbox, symlink target or None) for the read-only root."""
    if image:
        if not os.path.isdir(image):
            raise SandboxError(f"bwrap image {image!r} is not a rootfs directory on this host")
        names = sorted(set(os.listdir(image)) - _NOT_FROM_IMAGE)
        paths = [(f"/{name}", os.path.join(image, name)) for name in names]
    else:
        paths = [(path, path) for path in host_paths if os.path.lexists(path)]
    return [(inside, os.readlink(src) if os.path.islink(src) else None) for inside, src in paths]


def image_meta(rootfs: str | None) -> ImageMeta:
    """The image's recorded ENV and WORKDIR (empty when it has no record, or an unreadable one):
    read without following a symlink, at most 256 KiB."""
    if not rootfs:
        return ImageMeta()
    try:
        root = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return ImageMeta()
    try:
        etc_name, name = IMAGE_META.split("/")
        etc = os.open(etc_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=etc)
        finally:
            os.close(etc)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return ImageMeta()
            return ImageMeta.model_validate(json.loads(fh.read(_META_MAX + 1)[:_META_MAX]))
    except (OSError, ValueError, ValidationError):
        return ImageMeta()
    finally:
        os.close(root)


def image_env(env: dict[str, str]) -> dict[str, str]:
    """The image's own variables (its PATH first of all), where SandboxSpec would take them;
    the sandbox's HOME, TMPDIR and identity stay ours."""
    out: dict[str, str] = {}
    for name, value in env.items():
        if name in _IMAGE_ENV_KEPT:
            continue
        try:
            SandboxSpec.model_validate({"env": {name: value}})
        except ValueError:
            continue
        out[name] = value
    return out


def has_resolv(image: str | None) -> bool:
    """Whether the root has an /etc/resolv.conf to bind over (bwrap cannot create one in a
    read-only /etc; without it names do not resolve, addresses still do)."""
    return os.path.lexists(os.path.join(image or "/", "etc", "resolv.conf"))


def harness_root() -> str | None:
    """The node's harness installations (``settings.harness_root``), when it has them."""
    from config.settings import get_settings

    path = get_settings().harness_root
    return path if path and os.path.isdir(path) else None


def node_binds(image: str | None, writable: bool, host_paths: list[str] = ()) -> list[str]:
    """bwrap arguments binding the node's directories every root gets, read-only at the same
    path: the gateway's sockets (unlistable, each behind its own credential) and the harness
    root. A read-only image root needs the mount point already there (bwrap cannot make it in a
    read-only tree): an image without it goes without (a harness there ends as harness_error);
    a writable root gets the mount points made; the host's own root has them (and the harness
    root itself where one of its bound ``host_paths`` holds it)."""
    argv: list[str] = []
    harnesses = harness_root()
    for path in (gateway_dir(), harnesses):
        if not path:
            continue
        if image and not writable and not _is_dir_in(image, path):
            continue
        if not image and path == harnesses and any(_beneath(path, top) for top in host_paths):
            continue
        argv += ["--ro-bind", path, path]
    return argv + _tools_bind(image, writable)


def _tools_bind(image: str | None, writable: bool) -> list[str]:
    """The node's verifier toolkit (uv, its installer served offline) at its mount point, in an
    image root that can take it (:mod:`sandboxes.runtimes.images.verifier_tools`); read-only,
    harmless to an agent that finds it (it is not on the agent's PATH)."""
    from sandboxes.runtimes.images import verifier_tools

    if not image or (not writable and not _is_dir_in(image, verifier_tools.MOUNT)):
        return []  # asked first: a sandbox on the node's own root never needs the toolkit looked up
    tools = verifier_tools.built()
    return [] if tools is None else ["--ro-bind", str(tools), verifier_tools.MOUNT]


def _beneath(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _is_dir_in(image: str, path: str) -> bool:
    """Whether ``path`` is a directory inside the rootfs ``image`` (no symlink on the way: bwrap
    would resolve one inside the sandbox's root, not the image's)."""
    current = image
    for part in [p for p in path.split("/") if p]:
        current = os.path.join(current, part)
        if os.path.islink(current) or not os.path.isdir(current):
            return False
    return True

