"""The base layer of built environments: a rootfs made of this node's own Debian packages.

An environment (:mod:`sandboxes.runtimes.env.build`) needs a root with the node's Python, git,
patch, ``/bin/sh`` (dash: ``subprocess.run(..., shell=True)`` and every ``pip install -e .`` that
calls a shell need it) and bash, and nothing of the host's state. When the node has a C toolchain
(``build-essential``) and Python's headers (``python3-dev``), they come too, as in SWE-bench's
own images: requirements that PyPI has only as source (``pywatchman``) are compiled at build
time. This module copies the files of a fixed set of installed packages and of everything they
depend on (``dpkg-query``, alternatives resolved to what is installed) into a directory, without
documentation and locales, and adds the few files a root needs (``/etc/passwd``, ``/etc/group``,
the CA bundle pip verifies PyPI with at build time).

Its fingerprint is the list of ``package=version`` it was made from, so an upgrade of the node's
Python or git makes a new base (and new environments), never a silent change of an old one.
Files are copied, not linked: nothing built on top of the base can reach the host's own files.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from prorl_celery.errors import SandboxError

BASE_PACKAGES = ("bash", "dash", "coreutils", "git", "patch", "sed", "grep", "gawk", "findutils", "tar",
                 "gzip", "xz-utils", "bzip2", "diffutils", "python3", "python3-distutils",
                 "python3-lib2to3", "libc-bin")
BUILD_PACKAGES = ("build-essential", "python3-dev")  # taken when installed: a node may have no compiler
SKIP_PREFIXES = ("/usr/share/doc", "/usr/share/man", "/usr/share/info", "/usr/share/locale",
                 "/usr/share/lintian", "/usr/share/bug")
SKIP_FILES = {"EXTERNALLY-MANAGED"}  # the image's Python is ours to install into
# the node's directories sandboxes bind over a read-only image (sandboxes/runtimes/rootfs.py): the
# harness root and the gateway's sockets (a harness runs in a built environment), the verifier tools
MOUNT_POINTS = ("proc", "dev", "tmp", "root", "workspace", "usr/local", "var/tmp", "opt/prorl-harnesses",
                "run/prorl-gateway", "opt/prorl-tools")
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
LAYER_VERSION = "2"  # 2: the harness, gateway and tools mount points


def _query(*args: str) -> str:
    try:
        done = subprocess.run(["dpkg-query", *args], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SandboxError("building an environment needs dpkg (a Debian or Ubuntu node)") from None
    return done.stdout if done.returncode == 0 else ""


def installed() -> tuple[dict[str, str], dict[str, str]]:
    """(package -> version, virtual name -> a package providing it) of installed packages."""
    versions: dict[str, str] = {}
    provides: dict[str, str] = {}
    for line in _query("-W", "-f", "${Package}\t${Version}\t${db:Status-Status}\t${Provides}\n").splitlines():
        name, version, status, provided = (line.split("\t") + ["", "", ""])[:4]
        if status != "installed":
            continue
        versions[name] = version
        for item in filter(None, (part.strip().split(" ")[0] for part in provided.split(","))):
            provides.setdefault(item, name)
    return versions, provides


def _pick(alternatives: str, versions: dict[str, str], provides: dict[str, str]) -> str | None:
    for option in alternatives.split("|"):
        name = option.strip().split(" ")[0].split(":")[0]
        if name in versions:
            return name
        if name in provides:
            return provides[name]
    return None


def closure(roots: tuple[str, ...] = BASE_PACKAGES, optional: tuple[str, ...] = BUILD_PACKAGES) -> dict[str, str]:
    """Every installed package ``roots`` and the installed ones of ``optional`` need (Pre-Depends
    and Depends), name -> version."""
    versions, provides = installed()
    missing = [name for name in roots if name not in versions]
    if missing:
        raise SandboxError(f"the environment base needs these packages on the node: {', '.join(missing)} "
                           "(apt-get install them)")
    seen: set[str] = set()
    todo = [*roots, *(name for name in optional if name in versions)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for dep in filter(None, (d.strip() for d in _query("-W", "-f", "${Pre-Depends},${Depends}", name).split(","))):
            found = _pick(dep, versions, provides)
            if found and found not in seen:
                todo.append(found)
    return {name: versions[name] for name in sorted(seen)}


def fingerprint(packages: dict[str, str]) -> str:
    text = "\n".join([f"layer={LAYER_VERSION}", *(f"{k}={v}" for k, v in sorted(packages.items()))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _skipped(path: str) -> bool:
    return path.startswith(SKIP_PREFIXES) or os.path.basename(path) in SKIP_FILES


def _place(root: Path, path: str) -> None:
    """Copy one host path into ``root`` at its resolved location (a symlink stays a symlink,
    placed beside its resolved parent): nothing is ever written through a link."""
    parent = os.path.realpath(os.path.dirname(path))
    target = root / parent.lstrip("/") / os.path.basename(path)
    if os.path.islink(path):
        target.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(path), target)
    elif os.path.isdir(path):
        target.mkdir(parents=True, exist_ok=True)
    elif os.path.isfile(path) and not os.path.lexists(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def _alternatives(root: Path) -> None:
    """``/usr/bin/awk -> /etc/alternatives/awk -> ...`` for alternatives whose choice is in the root."""
    alt = Path("/etc/alternatives")
    if not alt.is_dir():
        return
    for bindir in ("/usr/bin", "/usr/sbin"):
        for entry in os.scandir(bindir):
            link = os.readlink(entry.path) if entry.is_symlink() else ""
            if link.startswith("/etc/alternatives/") and os.path.lexists(root / os.path.realpath(entry.path).lstrip("/")):
                _place(root, os.path.join("/etc/alternatives", os.path.basename(link)))
                _place(root, entry.path)


def _etc(root: Path) -> None:
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (etc / "hostname").write_text("sandbox\n")
    (etc / "resolv.conf").write_text("")  # a mount point: the build binds the node's over it
    if os.path.isfile(CA_BUNDLE):
        (etc / "ssl" / "certs").mkdir(parents=True, exist_ok=True)
        shutil.copy2(CA_BUNDLE, etc / "ssl" / "certs" / "ca-certificates.crt")


def build_base(dest: Path, packages: dict[str, str]) -> None:
    """Make the base rootfs at ``dest`` (which must not exist) from ``packages``."""
    dest.mkdir(parents=True)
    for name in ("bin", "lib", "lib32", "lib64", "libx32", "sbin"):  # merged /usr, as on the node
        if os.path.islink(f"/{name}"):
            os.symlink(os.readlink(f"/{name}"), dest / name)
    for name in packages:
        for path in _query("-L", name).splitlines():
            if path.startswith("/") and not _skipped(path) and os.path.lexists(path):
                _place(dest, path)
    _alternatives(dest)
    _etc(dest)
    for point in MOUNT_POINTS:
        (dest / point).mkdir(parents=True, exist_ok=True)
    (dest / "workspace" / "repo").mkdir(exist_ok=True)
    (dest / "tmp").chmod(0o1777)
