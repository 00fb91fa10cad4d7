"""The file-tree steps of an environment build: the base linked into a new image, the repository's
tree for the install, and the files the install generated inside it kept in the image."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from prorl_celery.errors import EnvBuildFailed
from sandboxes.runtimes.env import repo_overlay
from sandboxes.runtimes.env.recipe import RepoAt


def link_tree(base: Path, dest: Path) -> None:
    """``dest`` as hard links to the base's files (the build can write only /usr/local)."""
    for current, dirs, files in os.walk(base):
        rel = Path(current).relative_to(base)
        (dest / rel).mkdir(exist_ok=True)
        shutil.copystat(current, dest / rel)
        for name in dirs + files:
            src = Path(current) / name
            if src.is_symlink():
                os.symlink(os.readlink(src), dest / rel / name)
            elif name in files:
                os.link(src, dest / rel / name)


def repo_tree(repo: RepoAt, dest: Path) -> None:
    dest.mkdir(parents=True)
    source = Path(repo.source)
    if source.is_file():
        command = ["tar", "-xf", str(source), "-C", str(dest), "--no-same-owner"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    else:
        archive = subprocess.run(["git", "-C", str(source), "archive", "--format=tar", repo.commit],
                                 capture_output=True, timeout=600)
        if archive.returncode != 0:
            raise EnvBuildFailed(f"no commit {repo.commit} in {source}: {archive.stderr.decode()[-500:]}")
        done = subprocess.run(["tar", "-xf", "-", "-C", str(dest)], input=archive.stdout, capture_output=True, timeout=600)
    if done.returncode != 0:
        raise EnvBuildFailed(f"could not unpack the repository for the build: {str(done.stderr)[-500:]}")


_NOT_KEPT = {"__pycache__", ".eggs", "build", "dist", ".git"}


def files(tree: Path) -> set[str]:
    out = set()
    for current, dirs, files in os.walk(tree):
        dirs[:] = [d for d in dirs if d not in _NOT_KEPT and not d.endswith(".egg-info")]
        out.update(os.path.relpath(os.path.join(current, f), tree) for f in files)
    return out


def keep_generated(tree: Path, generated: list[str], image: Path, workdir: str) -> None:
    """Files the install wrote into the repository, kept in the image and served to every
    checkout's imports by :mod:`sandboxes.runtimes.env.repo_overlay` (nothing is written there)."""
    sites = sorted((image / "usr" / "local" / "lib").glob("python3*/dist-packages"))
    if not generated or not sites:
        return
    overlay = image / repo_overlay.OVERLAY.lstrip("/")
    for rel in generated:
        (overlay / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tree / rel, overlay / rel)
    source = Path(repo_overlay.__file__).read_text().replace(
        f'WORKDIR = "{repo_overlay.WORKDIR}"', f"WORKDIR = {workdir!r}")
    (sites[-1] / "_prorl_repo_overlay.py").write_text(source)
    (sites[-1] / "_prorl_repo_overlay.pth").write_text("import _prorl_repo_overlay\n")
