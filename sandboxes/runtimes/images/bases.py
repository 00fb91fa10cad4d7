"""Where a Dockerfile's FROM comes from when there is no Docker daemon.

1. The operator's map (``image_base_map``: glob over the reference as written -> base): a
   ``debian:<suite>`` root made by ``mmdebstrap`` from Debian's own archive (``image_base_mirror``)
   with ``image_base_packages``, ``scratch``, or ``toolkit:uv`` (a root holding only ``/uv`` and
   ``/uvx``, the verifier toolkit's uv from PyPI's wheel: what ``COPY --from=ghcr.io/astral-sh/uv``
   copies). Built once per (suite, packages, mirror) under
   ``<build dir>/bases/`` behind an flock, in a temporary directory renamed into place whole. Its
   apt works as the build's fake root (``APT::Sandbox::User "root"``). A reference mapped to
   another distribution says so (``ubuntu:24.04 built as debian:bookworm``); a ``python:*`` base
   gets Debian's python3 (bookworm's 3.11, trixie's 3.13: the default map gives ``python:3.12``
   and later trixie) with ``python`` and a pip that installs system-wide, as in the official image.
2. Else a registry the operator allows (``sandbox_registries``): the rootless pull of
   :mod:`sandboxes.runtimes.images.cache` (skopeo + umoci), keyed by its manifest digest.
3. Else :class:`ImageBuildFailed` naming the reference and the settings that would admit it.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict

from prorl_celery.errors import ImageBuildFailed, ProrlError
from sandboxes.runtimes.images.plan import DEFAULT_PATH
from sandboxes.runtimes.images.locks import locked

BASE_VERSION = "1"
PYTHONS = {"bookworm": "3.11", "trixie": "3.13"}  # Debian's python3 per suite
APT_SANDBOX = 'APT::Sandbox::User "root";\n'
DPKG_EXCLUDES = ("path-exclude=/usr/share/man/*", "path-exclude=/usr/share/doc/*",
                 "path-include=/usr/share/doc/*/copyright", "path-exclude=/usr/share/locale/*",
                 "path-exclude=/usr/share/info/*")


class Base(BaseModel):
    """What one FROM reference is built from."""

    model_config = ConfigDict(extra="forbid")

    from_ref: str
    kind: str  # "debian", "scratch" or "pulled"
    key: str  # what the image key takes from it
    description: str  # e.g. "debian:bookworm (mmdebstrap) for ubuntu:24.04"
    env: dict[str, str] = {}
    notes: list[str] = []
    suite: str | None = None
    python_flavour: bool = False


def _settings():
    from config.settings import get_settings

    return get_settings()


def _normal(ref: str) -> str:
    """``docker.io/library/python:3.12`` -> ``python:3.12``; no tag -> ``:latest``."""
    name = ref.split("@", 1)[0]
    for prefix in ("docker.io/library/", "docker.io/", "index.docker.io/library/"):
        name = name.removeprefix(prefix)
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def mapped(ref: str, mapping: dict[str, str]) -> str | None:
    """The base ``mapping`` names for ``ref`` (first pattern that matches), or None."""
    name = _normal(ref)
    candidates = [name, name.replace("-slim", "")]
    for pattern, target in mapping.items():
        if any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
            return target
    return None


def resolve(ref: str, deadline: float) -> Base:
    """How ``ref`` is had here (see the module doc); pulls nothing yet."""
    settings = _settings()
    if ref == "scratch":
        return Base(from_ref=ref, kind="scratch", key="scratch", description="scratch")
    target = mapped(ref, settings.image_base_map)
    if target == "scratch":
        return Base(from_ref=ref, kind="scratch", key="scratch", description=f"scratch for {ref}",
                    notes=[f"{ref} built as scratch (an empty root, PRORL_IMAGE_BASE_MAP)"])
    if target == "toolkit:uv":
        return _toolkit(ref)
    if target is not None:
        return _debian(ref, target)
    return _pulled(ref, deadline)


def _packages() -> list[str]:
    return sorted({p.strip() for p in _settings().image_base_packages.split(",") if p.strip()})


def _extra_cas() -> list[str]:
    """The PEM certificates of ``image_base_ca_bundle`` (none when unset or unreadable)."""
    path = _settings().image_base_ca_bundle
    try:
        text = Path(path).read_text() if path else ""
    except OSError:
        return []
    end = "-----END CERTIFICATE-----"
    return [block.strip()[block.strip().index("-----BEGIN CERTIFICATE-----"):] + f"\n{end}\n"
            for block in text.split(end) if "-----BEGIN CERTIFICATE-----" in block]


def _debian(ref: str, target: str) -> Base:
    distro, _, suite = target.partition(":")
    if distro != "debian" or not suite or not suite.replace("-", "").isalnum():
        raise ImageBuildFailed(f"PRORL_IMAGE_BASE_MAP maps {ref!r} to {target!r}: give debian:<suite>, scratch "
                               "or toolkit:uv")
    settings = _settings()
    text = "\n".join([f"version={BASE_VERSION}", f"suite={suite}", f"mirror={settings.image_base_mirror}",
                      f"ca={hashlib.sha256(''.join(_extra_cas()).encode()).hexdigest()}", *_packages()])
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    name = _normal(ref)
    python = name.split(":")[0] == "python"
    notes = [] if name.startswith("debian:") else [f"{ref} built as debian:{suite}"]
    if python:
        version = f" {PYTHONS[suite]}" if suite in PYTHONS else ""
        notes.append(f"{ref}: Debian {suite}'s python3{version} stands in for the image's own Python; "
                     "pip installs system-wide")
    env = {"PATH": DEFAULT_PATH, **({"LANG": "C.UTF-8"} if python else {})}
    return Base(from_ref=ref, kind="debian", key=f"debian-{suite}-{key}", suite=suite,
                description=f"debian:{suite} (mmdebstrap) for {ref}", env=env, notes=notes, python_flavour=python)


def _toolkit(ref: str) -> Base:
    from sandboxes.runtimes.images.verifier_tools import BUILDER, UV_VERSION

    return Base(from_ref=ref, kind="toolkit", key=f"toolkit-uv-{UV_VERSION}-b{BUILDER}",
                description=f"uv {UV_VERSION} from PyPI's wheel (the verifier toolkit's) for {ref}",
                notes=[f"{ref} built as the node's uv {UV_VERSION} from PyPI's wheel (/uv, /uvx; "
                       "PRORL_IMAGE_BASE_MAP: toolkit:uv)"])


def ensure_toolkit(base: Base, build_dir: Path, deadline: float) -> Path:
    """The root of a ``toolkit:uv`` base: ``/uv`` and ``/uvx`` copied from the node's verifier
    toolkit (built now unless there), as ghcr.io/astral-sh/uv's distroless image holds them."""
    from sandboxes.runtimes.images.verifier_tools import ensure_tools

    def make(root: Path) -> None:
        tools = ensure_tools()
        root.mkdir(mode=0o755)
        for name in ("uv", "uvx"):
            shutil.copyfile(tools / "bin" / name, root / name)
            (root / name).chmod(0o755)

    return _built_once(base, build_dir, deadline, make)


def _pulled(ref: str, deadline: float) -> Base:
    from sandboxes.images import DOCKER, parse_docker, registry_allowed

    settings = _settings()
    try:
        image = parse_docker(f"{DOCKER}{ref}", field="FROM")
    except ProrlError as exc:
        raise ImageBuildFailed(f"image {ref}: {exc}") from None
    if not registry_allowed(image):
        raise ImageBuildFailed(
            f"image {ref}: no base is mapped for it (PRORL_IMAGE_BASE_MAP patterns: "
            f"{', '.join(settings.image_base_map) or 'none'}) and its registry {image.registry!r} is not "
            f"allowed (PRORL_SANDBOX_REGISTRIES: {settings.sandbox_registries or 'none'}); map it to a "
            "debian:<suite> base or allow its registry")
    from sandboxes.runtimes.images.cache import default_cache

    try:
        digest, _manifest = default_cache().resolve(image, deadline)
    except ProrlError as exc:
        raise ImageBuildFailed(f"image {ref}: {exc}") from None
    return Base(from_ref=ref, kind="pulled", key=digest, description=f"{image.canonical}@{digest} (pulled)")


def pulled_rootfs(base: Base, deadline: float) -> tuple[str, dict[str, str], Callable[[], None]]:
    """(rootfs, the image's env, release) of a pulled base, held until released."""
    from sandboxes.images import DOCKER, parse_docker
    from sandboxes.runtimes.images.cache import default_cache

    try:
        lease = default_cache().acquire(parse_docker(f"{DOCKER}{base.from_ref}", field="FROM"))
    except ProrlError as exc:
        raise ImageBuildFailed(f"image {base.from_ref}: {exc}") from None
    return lease.rootfs, dict(lease.env), lease.release


def ensure_debian(base: Base, build_dir: Path, deadline: float) -> Path:
    """The mmdebstrap root of ``base``, built now unless it exists."""
    def make(root: Path) -> None:
        _mmdebstrap(base, root, build_dir / "bases" / f"{base.key}.log", deadline)
        os.chmod(root, 0o755)

    return _built_once(base, build_dir, deadline, make)


def _built_once(base: Base, build_dir: Path, deadline: float, make: Callable[[Path], None]) -> Path:
    """``<build_dir>/bases/<key>``: made by ``make(root)`` in a scratch directory beside it under the
    base's lock, then renamed into place whole (a killed build leaves only scratch, removed by the
    next holder of the lock); every node and sample reading the same directory shares it."""
    bases = build_dir / "bases"
    bases.mkdir(mode=0o711, exist_ok=True)
    final = bases / base.key
    if final.exists():
        return final
    with locked(bases / f"{base.key}.lock", deadline, f"the {base.description} base"):
        if final.exists():
            return final
        for stale in bases.glob(f".{base.key}.*"):  # a killed build's (the lock is ours now)
            shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{base.key}.", dir=bases))
        try:
            make(scratch / "rootfs")
            os.rename(scratch / "rootfs", final)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return final


def _mmdebstrap(base: Base, dest: Path, log: Path, deadline: float) -> None:
    tool = shutil.which("mmdebstrap")
    if not tool:
        raise ImageBuildFailed(f"building the {base.description} base needs mmdebstrap "
                               "(scripts/install-system-deps.sh installs it)")
    settings = _settings()
    hooks = []
    cas = _extra_cas()
    if cas:
        local = dest.parent / "prorl-node-cas"
        local.mkdir()
        for index, pem in enumerate(cas):
            (local / f"prorl-node-{index:03d}.crt").write_text(pem)
        hooks = [f"--customize-hook=copy-in {local} /usr/local/share/ca-certificates",
                 '--customize-hook=chroot "$1" update-ca-certificates']
    argv = [tool, "--variant=apt", "--format=directory", f"--include={','.join(_packages())}",
            *(f"--dpkgopt={opt}" for opt in DPKG_EXCLUDES), *hooks, base.suite or "", str(dest),
            settings.image_base_mirror]
    started = time.monotonic()
    with open(log, "wb") as out:
        try:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=max(1.0, deadline - time.monotonic()), start_new_session=True)
        except subprocess.TimeoutExpired:
            raise ImageBuildFailed(f"building the {base.description} base took past the build's timeout "
                                   f"(log: {log})") from None
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise ImageBuildFailed(f"building the {base.description} base failed (exit {done.returncode}; "
                               f"log: {log}):\n{tail}")
    (dest / "etc" / "apt" / "apt.conf.d" / "99prorl-sandbox").write_text(APT_SANDBOX)
    resolv = dest / "etc" / "resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    resolv.write_text("")
    resolv.chmod(0o644)
    (dest / "etc" / "prorl-base.json").write_text(json.dumps(
        {"suite": base.suite, "packages": _packages(), "mirror": settings.image_base_mirror,
         "build_s": round(time.monotonic() - started, 1)}, indent=1))
