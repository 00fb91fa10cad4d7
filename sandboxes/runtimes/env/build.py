"""Environments for instances that come without an image: a recipe built once into a rootfs.

A recipe (:class:`EnvRecipe`) names the Python the node must have, pinned packages, requirement
lines and install commands, and optionally the repository at a commit to install from (as
SWE-bench's ``pip install -e .``). :func:`ensure_env` builds it on this node into
``<env_dir>/env-<key>`` and returns that directory, a rootfs that bwrap sandboxes then use
read-only as their ``image`` (the operator lists ``env_dir`` in ``PRORL_SANDBOX_IMAGE_DIRS``).

- The key is a hash of the recipe (its ``name`` and ``notes`` aside) and of the base layer
  (:mod:`sandboxes.runtimes.env.base`: the node's own packages, by version).
- Built once: concurrent callers, threads or processes, wait on one lock and share the build; a
  finished environment is renamed into place whole, so a half-built one is never used.
- The build runs in a bwrap sandbox whose root is the environment, read-only but for
  ``/usr/local`` (where pip installs), ``/root`` and ``/tmp``; the repository tree is bound at
  ``workdir``, the path the instance's checkout has in every sandbox, so an editable install
  points at each sandbox's own checkout. Network is the node's, at build time only (PyPI, or
  the operator's ``PIP_INDEX_URL``); a root host runs it as ``env_build_uid``, then gives the
  result to root. Sandboxes that use the environment get no network from it.
- A build that fails or outlasts ``env_build_timeout_s`` raises :class:`EnvBuildFailed` with
  the tail of its log (the whole log stays beside the environment).

CLI: ``python -m sandboxes.runtimes.env.build build RECIPE.json`` prints the image directory;
``key`` prints where it would be. A domain that makes recipes from its own rows gives them to
:func:`run` (the SWE room's ``python -m tasks.swe.env``).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from prorl_celery.errors import EnvBuildFailed, SandboxError
from sandboxes.runtimes.env import base as envbase
from sandboxes.runtimes.env import tree as envtree
from sandboxes.runtimes.env.recipe import PIP_VERSION, EnvRecipe, RepoAt, script

__all__ = ["EnvBuildFailed", "EnvRecipe", "RepoAt", "env_dir", "ensure_base", "ensure_env", "key_of", "script",
           "node_python", "run", "main"]

BUILD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_ENV = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "HTTPS_PROXY", "HTTP_PROXY",
              "NO_PROXY", "https_proxy", "http_proxy", "no_proxy")
MARKER = "etc/prorl-env.json"
COMMANDS = ("build", "key")  # the CLI's


def _settings():
    from config.settings import get_settings

    return get_settings()


def env_dir() -> Path:
    """``env_dir``, or its default: root's home is closed to the sandbox uids, so a root host
    keeps environments in /var/cache."""
    from sandboxes import dirs

    return dirs.env_dir()


def _make_root(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o711)  # the build uid and the sandbox uids enter it, nobody lists it
    if os.geteuid() == 0:  # they run as other uids: every directory above must let them through
        closed = [str(p) for p in root.resolve().parents if not os.stat(p).st_mode & 0o001]
        if closed:
            raise EnvBuildFailed(f"environment directory {root} is beneath {closed[0]}, which the build "
                                 "and sandbox uids cannot enter (set env_dir elsewhere)")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure_base(root: Path) -> tuple[Path, str]:
    """The base layer for this node's packages, built if missing; (its directory, fingerprint)."""
    _make_root(root)
    packages = envbase.closure()
    mark = envbase.fingerprint(packages)
    final = root / f"base-{mark}"
    if not final.exists():
        with _locked(root / f"base-{mark}.lock"):
            if not final.exists():
                scratch = Path(tempfile.mkdtemp(prefix=f".base-{mark}.", dir=root))
                scratch.chmod(0o711)
                try:
                    envbase.build_base(scratch / "rootfs", packages)
                    (scratch / "rootfs" / "etc" / "prorl-base.json").write_text(json.dumps(packages, indent=1))
                    os.rename(scratch / "rootfs", final)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
    return final, mark


def _node_python(base: Path) -> str:
    packages = json.loads((base / "etc" / "prorl-base.json").read_text())
    version = packages.get("python3", "")
    return version.split("-")[0]


def key_of(recipe: EnvRecipe, root: Path | None = None) -> tuple[str, Path]:
    root = root or env_dir()
    _base, mark = ensure_base(root)
    key = recipe.key(mark)
    return key, root / f"env-{key}"


def ensure_env(recipe: EnvRecipe, root: Path | None = None, timeout: float | None = None) -> Path:
    """The environment's rootfs directory, built now unless it already exists (see module doc)."""
    root = root or env_dir()
    base, mark = ensure_base(root)
    if not _node_python(base).startswith(recipe.python):
        raise EnvBuildFailed(f"recipe {recipe.name or ''} wants Python {recipe.python}; this node's "
                             f"python3 is {_node_python(base)}")
    final = root / f"env-{recipe.key(mark)}"
    if final.exists():
        return final
    with _locked(final.with_name(final.name + ".lock")):
        if final.exists():
            return final  # a concurrent caller built it while we waited
        started = time.monotonic()
        scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        scratch.chmod(0o711)
        try:
            image = scratch / "rootfs"
            envtree.link_tree(base, image)
            _build(recipe, image, scratch, root, final.with_suffix(".log"),
                   timeout or _settings().env_build_timeout_s)
            (image / MARKER).write_text(json.dumps({"recipe": recipe.model_dump(), "base": mark,
                                                    "build_s": round(time.monotonic() - started, 1)}, indent=1))
            os.rename(image, final)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return final


def _bootstrap_pip(root: Path) -> Path:
    """pip's own wheel, downloaded once by this process's pip (the build runs it from the wheel)."""
    wheels = root / "bootstrap"
    wheels.mkdir(exist_ok=True)
    with _locked(root / "bootstrap.lock"):
        found = sorted(wheels.glob(f"pip-{PIP_VERSION}-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                            f"pip=={PIP_VERSION}"], check=False, capture_output=True, timeout=600)
            found = sorted(wheels.glob(f"pip-{PIP_VERSION}-*.whl"))
        if not found:
            raise EnvBuildFailed(f"could not download pip {PIP_VERSION} to bootstrap the environment")
    return found[0]


def build_argv(recipe: EnvRecipe, image: Path, scratch: Path, pip_wheel: Path, uid: int | None) -> list[str]:
    prefix = [] if uid is None else [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}",
                                     "--clear-groups", "--"]
    env = {"PATH": BUILD_PATH, "HOME": "/root", "LANG": "C.UTF-8", "PIP_NO_INPUT": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_ROOT_USER_ACTION": "ignore", "PIP_USE_PEP517": "1",
           "PIP_CACHE_DIR": "/root/.cache/pip", "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt",
           **{k: os.environ[k] for k in PASSED_ENV if k in os.environ}, **recipe.env}
    argv = [*prefix, shutil.which("bwrap") or "bwrap", "--unshare-all", "--share-net", "--die-with-parent",
            "--new-session", "--uid", "0", "--gid", "0", "--hostname", "envbuild", "--clearenv",
            "--ro-bind", str(image), "/", "--bind", str(image / "usr" / "local"), "/usr/local",
            "--bind", str(scratch / "home"), "/root", "--bind", str(scratch.parent / "pip-cache"), "/root/.cache/pip",
            "--bind", str(scratch / "repo"), recipe.workdir,
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--ro-bind", str(pip_wheel.parent), "/tmp/prorl-bootstrap", "--chdir", recipe.workdir]
    if os.path.exists("/etc/resolv.conf"):
        argv += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
    for name, value in env.items():
        argv += ["--setenv", name, value]
    return argv + ["bash", "-c", script(recipe, f"/tmp/prorl-bootstrap/{pip_wheel.name}")]


def _build(recipe: EnvRecipe, image: Path, scratch: Path, root: Path, log: Path, timeout: float) -> None:
    uid = _settings().env_build_uid if os.geteuid() == 0 else None
    (scratch / "home" / ".cache" / "pip").mkdir(parents=True)
    pip_cache = root / "pip-cache"
    pip_cache.mkdir(exist_ok=True)
    if recipe.repo:
        envtree.repo_tree(recipe.repo, scratch / "repo")
    else:
        (scratch / "repo").mkdir()
    if recipe.workdir != "/workspace/repo":
        (image / recipe.workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
    if uid is not None:
        for path in (image / "usr" / "local", scratch / "home", scratch / "repo", pip_cache):
            subprocess.run(["chown", "-R", f"{uid}:{uid}", str(path)], check=True)
    before = envtree.files(scratch / "repo")
    argv = build_argv(recipe, image, scratch, _bootstrap_pip(root), uid)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise EnvBuildFailed(f"building {recipe.name or 'the environment'} took over {timeout:.0f} s "
                                 f"(log: {log})") from None
    if uid is not None:
        subprocess.run(["chown", "-R", "0:0", str(image / "usr" / "local")], check=True)
    if code != 0:
        tail = log.read_bytes()[-2500:].decode(errors="replace")
        raise EnvBuildFailed(f"building {recipe.name or 'the environment'} failed (exit {code}; log: {log}):\n{tail}")
    envtree.keep_generated(scratch / "repo", sorted(envtree.files(scratch / "repo") - before), image, recipe.workdir)


def node_python() -> str:
    """The ``x.y`` of this node's python3, the Python every environment built here runs."""
    return ".".join(_node_python(ensure_base(env_dir())[0]).split(".")[:2])


def run(command: str, recipe: EnvRecipe) -> int:
    """The CLI's work on ``recipe``: ``build`` prints its image directory (built unless it
    exists), ``key`` where it would be; a failure is one line on stderr and status 1."""
    try:
        print(ensure_env(recipe) if command == "build" else key_of(recipe)[1])
    except SandboxError as exc:
        print(f"{exc.type}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandboxes.runtimes.env.build", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("recipe", help="An EnvRecipe as JSON.")
    args = parser.parse_args(argv)
    return run(args.command, EnvRecipe.model_validate_json(Path(args.recipe).read_text()))


if __name__ == "__main__":
    sys.exit(main())
