"""Getting a repository into a sandbox at a given commit, without its history.

Per host, each https repository is cloned once into a bare mirror (``repo_cache``, one lock per
mirror, so concurrent inits share the clone; refreshed only when a commit is missing). A
local repository the operator allows (a work tree, a bare mirror, or their ``file://`` URL) is
read where it is. For a commit the worker packs that commit and its one tree (``git rev-list
--objects --no-walk | git pack-objects``: no parent, no history) once, caches the pack by commit
id (``repo_pack_cache_mb``, least recently used first out), and writes it into the sandbox, where
a checkout (the worker indexed it) turns it into a one-commit shallow repository at the very same
commit id: ``git diff <base_commit>``, ``git show <base_commit>:path`` and ``git checkout
<base_commit> -- path`` work as in a full clone. No tar is unpacked, so no owner is restored: a
service that is not root checks out as well as one that is. The sandbox needs git and no network.

A request names the source, so it gets no more than the operator allows
(:func:`sandboxes.policy.check_repo_source`): a path or ``file://`` URL only beneath
``PRORL_REPO_SOURCE_DIRS`` (after resolving links), else an https URL, which git fetches as an
unprivileged uid (``repo_clone_uid`` when the worker is root) with every protocol but https off,
its environment cleared and ``--`` before the URL. Git reads the repository with no system or
global config, hooks and fsmonitor off.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from prorl_celery.errors import InvalidRequest, SandboxError
from sandboxes.policy import check_repo_source

CLONE_PATH = "/usr/local/bin:/usr/bin:/bin"
CLONE_TIMEOUT_S = 1800
PACK_TIMEOUT_S = 600
_SHA = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")
_SAFE = ["-c", "protocol.allow=never", "-c", "protocol.https.allow=always", "-c", "core.hooksPath=/dev/null",
         "-c", "core.fsmonitor=false", "-c", "safe.directory=*"]


def repo_source(instance: dict[str, Any]) -> str:
    return instance.get("repo_source") or f"https://github.com/{instance['repo']}.git"


def cache_dir() -> Path:
    from config.settings import get_settings

    configured = get_settings().repo_cache
    return Path(configured) if configured else Path.home() / ".cache" / "prorl-celery" / "repos"


def _env(home: str) -> dict[str, str]:
    return {"PATH": CLONE_PATH, "HOME": home, "LANG": "C.UTF-8", "GIT_TERMINAL_PROMPT": "0",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}


def _git_bin() -> str:
    git = shutil.which("git")
    if git is None:
        raise SandboxError("git is not installed on this worker")
    return git


def _git(git_dir: Path, *args: str, timeout: float = PACK_TIMEOUT_S, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("stdout", subprocess.PIPE)
    return subprocess.run([_git_bin(), *_SAFE, f"--git-dir={git_dir}", *args], env=_env(tempfile.gettempdir()),
                          stderr=subprocess.PIPE, timeout=timeout, **kw)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def git_dir_of(path: Path) -> Path:
    """The git directory of a work tree or of a bare repository at ``path``."""
    if (path / ".git").is_dir():
        return path / ".git"
    if (path / "HEAD").is_file() and (path / "objects").is_dir():
        return path
    raise SandboxError(f"{path} is not a git repository (neither a work tree nor a bare one)")


def has_commit(git_dir: Path, commit: str) -> bool:
    return _git(git_dir, "cat-file", "-e", f"{commit}^{{commit}}", timeout=60).returncode == 0


def local_repo(instance: dict[str, Any]) -> Path:
    """The git directory holding the instance's ``base_commit`` on this machine: an allowed
    local repository as it is, or this host's mirror of an https URL (cloned once, fetched
    again when the commit is missing). Anything else is :class:`PolicyDenied`."""
    with held_repo(instance) as git_dir:
        return git_dir


@contextmanager
def held_repo(instance: dict[str, Any]) -> Iterator[Path]:
    """:func:`local_repo`, with a mirror's lock held until the caller is done reading it (a
    refresh replaces the mirror)."""
    kind, source = check_repo_source(repo_source(instance))
    commit = instance["base_commit"]
    if kind == "dir":
        git_dir = git_dir_of(Path(source))
        if not has_commit(git_dir, commit):
            raise SandboxError(f"commit {commit} is not in the repository at {source}")
        yield git_dir
        return
    target = cache_dir() / f"{hashlib.sha1(source.encode()).hexdigest()[:16]}.git"
    with _locked(target.with_suffix(".lock")):
        if not (target / "HEAD").exists():
            clone(source, target)
        if not has_commit(target, commit):
            refresh(source, target)
        if not has_commit(target, commit):
            raise SandboxError(f"commit {commit} is not in {source}")
        yield target


def clone_uid() -> int | None:
    """The uid a clone runs as: ``repo_clone_uid`` when this process is root, else None (we
    already are an unprivileged user)."""
    from config.settings import get_settings

    return get_settings().repo_clone_uid if os.geteuid() == 0 else None


def _as_uid(uid: int | None) -> list[str]:
    return [] if uid is None else [shutil.which("setpriv") or "setpriv", f"--reuid={uid}",
                                   f"--regid={uid}", "--clear-groups", "--"]


def clone_argv(url: str, dest: str, uid: int | None, git: str = "git") -> list[str]:
    """The mirror clone's command line (pure): https only, no other protocol (``ext::``,
    ``file``, ``ssh`` ...), the URL after ``--`` so it can never be read as an option."""
    return [*_as_uid(uid), git, *_SAFE, "clone", "--mirror", "--quiet", "--", url, dest]


def _run_as(argv: list[str], uid: int | None, work: Path, what: str) -> None:
    try:
        done = subprocess.run(argv, cwd=work, env=_env(str(work)), capture_output=True, text=True,
                              timeout=CLONE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SandboxError(f"could not {what}: over {CLONE_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise SandboxError(f"could not {what} (as uid {os.geteuid() if uid is None else uid}): "
                           f"{(done.stderr or done.stdout)[-1500:]}")


def _check_setpriv(uid: int | None) -> None:
    if uid is not None and shutil.which("setpriv") is None:
        raise SandboxError("refusing to clone as root: setpriv (util-linux) is missing")


def clone(url: str, target: Path) -> None:
    """A bare mirror of ``url``, cloned as :func:`clone_uid` into a fresh directory that uid
    owns, then moved to ``target``; the caller holds the mirror's lock."""
    uid = clone_uid()
    git = _git_bin()
    _check_setpriv(uid)
    work = Path(tempfile.mkdtemp(prefix="prorl-clone-"))
    try:
        if uid is not None:
            os.chown(work, uid, uid)
        _run_as(clone_argv(url, str(work / "repo.git"), uid, git), uid, work, f"clone {url}")
        shutil.move(str(work / "repo.git"), str(target))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def refresh(url: str, target: Path) -> None:
    """Bring the mirror at ``target`` up to date (it lacks a commit); the caller holds its lock.
    A worker that is not root fetches in place; a root worker's clones run as ``repo_clone_uid``,
    which cannot reach the cache (beneath root's home), so it clones afresh and swaps."""
    uid = clone_uid()
    if uid is None:
        _run_as([_git_bin(), *_SAFE, f"--git-dir={target}", "fetch", "--quiet", "--prune", "--", url,
                 "+refs/*:refs/*"], None, target, f"fetch {url}")
        return
    fresh = target.with_name(f"{target.name}.fresh")
    shutil.rmtree(fresh, ignore_errors=True)
    clone(url, fresh)
    old = target.with_name(f"{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    target.rename(old)
    fresh.rename(target)
    shutil.rmtree(old, ignore_errors=True)


# -- one commit, packed -------------------------------------------------------------------
def _pack_budget() -> int:
    from config.settings import get_settings

    return get_settings().repo_pack_cache_mb * 1024 * 1024


def build_pack(git_dir: Path, commit: str, out: Path) -> None:
    """A pack of ``commit`` and every tree and blob of its tree (no parents) at ``out``, and its
    index beside it (``.idx``: the sandbox then need not index it)."""
    objects = _git(git_dir, "rev-list", "--objects", "--no-walk", commit)
    if objects.returncode != 0:
        raise SandboxError(f"cannot list the objects of {commit}: {objects.stderr.decode()[-500:]}")
    with open(out, "wb") as sink:
        done = _git(git_dir, "pack-objects", "--stdout", "-q", input=objects.stdout, stdout=sink)
    if done.returncode != 0:
        raise SandboxError(f"cannot pack {commit}: {done.stderr.decode()[-500:]}")
    indexed = _git(git_dir, "index-pack", "-o", str(out.with_suffix(".idx")), str(out))
    if indexed.returncode != 0:
        raise SandboxError(f"cannot index the pack of {commit}: {indexed.stderr.decode()[-500:]}")


def commit_pack(instance: dict[str, Any]) -> Path:
    """The cached pack of the instance's ``base_commit`` (built on first use)."""
    commit = instance["base_commit"]
    if not isinstance(commit, str) or not _SHA.match(commit):
        raise InvalidRequest("base_commit must be a full commit id (40 hex digits)", field="instance.base_commit")
    check_repo_source(repo_source(instance))  # the worker's own check, cached pack or not
    packs = cache_dir() / "packs"
    path = packs / f"{commit}.pack"
    with _locked(packs / f"{commit}.lock"):
        if path.exists() and path.with_suffix(".idx").exists():  # (a cache older than .idx rebuilds)
            os.utime(path)
            return path
        partial = packs / f"{commit}.partial.pack"
        with held_repo(instance) as git_dir:
            build_pack(git_dir, commit, partial)
        partial.with_suffix(".idx").rename(path.with_suffix(".idx"))
        partial.rename(path)  # last: a .pack is complete with its .idx
    evict_packs(packs, _pack_budget(), keep=path)
    return path


def evict_packs(packs: Path, budget: int, keep: Path) -> None:
    """Oldest-used packs out until the rest fit in ``budget`` bytes (``keep`` stays)."""
    found = sorted((p for p in packs.glob("*.pack") if not p.name.endswith(".partial.pack")),
                   key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in found)
    for pack in found:
        if total <= budget:
            break
        if pack != keep:
            total -= pack.stat().st_size
            pack.unlink(missing_ok=True)
            pack.with_suffix(".idx").unlink(missing_ok=True)
            (packs / f"{pack.stem}.lock").unlink(missing_ok=True)


def checkout_script(dest: str, commit: str) -> str:
    """The sandbox side: ``{dest}.pack`` and ``.idx`` become a shallow repository at ``commit`` in
    ``dest``."""
    d, c = shlex.quote(dest), shlex.quote(commit)
    pack = f"{d}/.git/objects/pack/prorl-base"
    return (f"rm -rf {d} && mkdir -p {d} && git -c init.defaultBranch=main init -q {d} && "
            f"mv {d}.idx {pack}.idx && mv {d}.pack {pack}.pack && echo {c} > {d}/.git/shallow && "
            f"git -C {d} -c advice.detachedHead=false checkout -q -f {c} && cd {d} && pwd")


def checkout_into(box, instance: dict[str, Any], dest: str) -> str:
    """Put the instance's repository at ``base_commit`` at ``dest`` in the sandbox (a shallow
    repository of that one commit); returns the absolute path of its root inside the sandbox.
    A relative ``dest`` is beneath the workspace, where the shell must be (as in a new sandbox)."""
    pack = commit_pack(instance)
    box.write_file(f"{dest}.pack", pack.read_bytes())
    box.write_file(f"{dest}.idx", pack.with_suffix(".idx").read_bytes())
    out = box.exec(checkout_script(dest, instance["base_commit"]), timeout=600)
    if out.exit_code != 0:
        raise SandboxError(f"could not check out {instance.get('repo')} at {instance['base_commit']}: "
                           f"{out.output[-1000:]}")
    root = out.output.strip().splitlines()[-1]
    box.exec("cd - >/dev/null")
    return root


def pack_bytes(instance: dict[str, Any]) -> int:
    """Bytes a checkout of the instance writes into a sandbox (the commit's pack and index)."""
    pack = commit_pack(instance)
    return pack.stat().st_size + pack.with_suffix(".idx").stat().st_size
