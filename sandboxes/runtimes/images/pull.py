"""One rootless pull: ``skopeo`` fetches a manifest or copies an image into an OCI layout,
``umoci raw unpack --rootless`` makes a rootfs of it, and :func:`sanitize` makes that rootfs fit for a
read-only sandbox root.

skopeo runs with a configuration of our own (a policy that accepts what it is given — the digest
is pinned by the caller —, no system or user ``registries.conf``, so no mirror or short-name
rewrite moves a pull away from the registry the allow-list judged; ``HOME`` and ``TMPDIR`` in
the cache). Every call is bounded by the caller's deadline and killed with its process group.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

from prorl_celery.errors import ImageNotFound, ImageUnavailable
from sandboxes.runtimes.procs import run_bounded
from sandboxes.images import ImageRef, insecure

_NOT_FOUND = ("manifest unknown", "name unknown", "not found", "no such file", "does not exist",
              "no descriptor found", "repository name not known")
_POLICY = {"default": [{"type": "insecureAcceptAnything"}]}
OUTPUT_CHARS = 1500


def tool(name: str) -> str:
    found = shutil.which(name)
    if not found:
        raise ImageUnavailable(f"{name} is not installed on this sandbox host "
                               "(scripts/install-system-deps.sh installs skopeo and umoci)",
                               field="spec.image")
    return found


class Tools:
    """The environment and configuration files skopeo and umoci run with, under ``home``."""

    def __init__(self, home: Path):
        self.home = home
        home.mkdir(mode=0o700, exist_ok=True)
        (home / "tmp").mkdir(mode=0o700, exist_ok=True)
        self.policy = home / "policy.json"
        self.policy.write_text(json.dumps(_POLICY))
        self.registries = home / "registries.conf"
        self.registries.write_text("# prorl-celery: no mirrors, no short names, no rewrites\n")

    def env(self) -> dict[str, str]:
        return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": str(self.home), "TMPDIR": str(self.home / "tmp"), "LANG": "C.UTF-8",
                "CONTAINERS_REGISTRIES_CONF": str(self.registries),
                "CONTAINERS_POLICY_JSON": str(self.policy)}

    def run(self, argv: list[str], deadline: float, ref: ImageRef, what: str) -> bytes:
        """stdout of ``argv``; a failure is :class:`ImageNotFound` or :class:`ImageUnavailable`."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ImageUnavailable(f"{what} of {ref.canonical!r} did not finish in time "
                                   "(PRORL_SANDBOX_IMAGE_PULL_TIMEOUT_S)", field="spec.image")
        try:
            done = run_bounded(argv, remaining, env=self.env(), cwd=self.home)
        except subprocess.TimeoutExpired:
            raise ImageUnavailable(f"{what} of {ref.canonical!r} did not finish in time "
                                   "(PRORL_SANDBOX_IMAGE_PULL_TIMEOUT_S)", field="spec.image") from None
        if done.returncode != 0:
            raise classify(done.stderr.decode(errors="replace"), ref, what)
        return done.stdout

    def _tls(self, ref: ImageRef, flag: str) -> list[str]:
        if ref.transport != "docker":
            return []
        return [f"--{flag}=false"] if insecure(ref) else [f"--{flag}=true"]

    def manifest(self, ref: ImageRef, deadline: float) -> tuple[str, dict]:
        """(digest, manifest) of what ``ref`` names now: one manifest request, no blobs."""
        raw = self.run([tool("skopeo"), "--policy", str(self.policy), "inspect", "--raw",
                        "--retry-times", "1", *self._tls(ref, "tls-verify"), ref.skopeo()],
                       deadline, ref, "resolving")
        try:
            manifest = json.loads(raw)
        except ValueError:
            raise ImageUnavailable(f"{ref.canonical!r}: the registry's manifest is not JSON",
                                   field="spec.image") from None
        return f"sha256:{hashlib.sha256(raw).hexdigest()}", manifest

    def copy(self, ref: ImageRef, digest: str, layout: Path, deadline: float) -> None:
        """The image, pinned to ``digest`` (docker), into an OCI layout as tag ``img``."""
        self.run([tool("skopeo"), "--policy", str(self.policy), "copy", "--quiet",
                  "--retry-times", "1", *self._tls(ref, "src-tls-verify"),
                  ref.skopeo(digest if ref.transport == "docker" else None), f"oci:{layout}:img"],
                 deadline, ref, "pulling")

    def unpack(self, ref: ImageRef, layout: Path, rootfs: Path, deadline: float) -> None:
        """The layers into ``rootfs`` (``raw unpack``: no mtree manifest, which would hash
        every file and costs several times the unpack itself)."""
        self.run([tool("umoci"), "raw", "unpack", "--rootless", "--image", f"{layout}:img",
                  str(rootfs)], deadline, ref, "unpacking")


def classify(stderr: str, ref: ImageRef, what: str) -> ImageNotFound | ImageUnavailable:
    text = " ".join(stderr.split())[-OUTPUT_CHARS:]
    lowered = text.lower()
    if what != "unpacking" and any(marker in lowered for marker in _NOT_FOUND):
        return ImageNotFound(f"no image {ref.canonical!r}: {text}", field="spec.image")
    return ImageUnavailable(f"{what} {ref.canonical!r} failed: {text}", field="spec.image")


def layer_bytes(manifest: dict) -> int | None:
    """Compressed size of an image manifest's layers; None for an index (sizes not known yet)."""
    layers = manifest.get("layers")
    if not isinstance(layers, list):
        return None
    return sum(int(layer.get("size") or 0) for layer in layers if isinstance(layer, dict))


def sanitize(rootfs: Path) -> int:
    """Make an unpacked rootfs fit for a sandbox root; return its size in bytes (blocks).

    Device nodes, fifos and sockets are removed (a sandbox gets its own /dev); setuid, setgid
    and sticky bits and every write bit for group and others are dropped; what the image's owner
    may read or run, others may too (a sandbox's uid is not the cache's owner, and inside the
    sandbox it is the image's root). Nothing is followed: symlinks stay links, checked by lstat.
    """
    size = 0
    for directory, dirs, files in os.walk(rootfs):
        for name in dirs + files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            mode = st.st_mode
            if stat.S_ISLNK(mode):
                continue
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                os.unlink(path)
                continue
            size += st.st_blocks * 512
            perm = stat.S_IMODE(mode) & 0o755
            perm |= (perm >> 3 & 0o050) | (perm >> 6 & 0o005)  # others (and group) read/run as the owner
            if perm != stat.S_IMODE(mode):
                os.chmod(path, perm)
    os.chmod(rootfs, 0o755)
    return size


def _blob(layout: Path, descriptor: dict) -> dict:
    algorithm, _, digest = str(descriptor.get("digest", "")).partition(":")
    if algorithm != "sha256" or not digest.isalnum():
        raise ValueError("not a sha256 descriptor")
    return json.loads((layout / "blobs" / "sha256" / digest).read_text())


def image_config(layout: Path) -> dict:
    """``{"env": {...}, "workdir": ...}`` of the image config in our copy of the layout."""
    try:
        manifest = _blob(layout, json.loads((layout / "index.json").read_text())["manifests"][0])
        config = _blob(layout, manifest["config"]).get("config") or {}
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return {"env": {}, "workdir": None}
    env = dict(item.split("=", 1) for item in config.get("Env") or [] if isinstance(item, str) and "=" in item)
    return {"env": env, "workdir": config.get("WorkingDir") or None}
