"""Real SWE-bench rows and their repositories, shipped small in ``tests/fixtures/swebench``.

Each repository is kept as the tree of its ``base_commit`` (``git archive``, xz) and that commit's
raw object. :func:`materialize` unpacks the tree into a one-commit git repository whose commit is
byte for byte the original, so its id is the row's ``base_commit`` (a shallow repository: the
parent is recorded, not present), with that commit checked out. :func:`pack` makes those files
from a full clone, :func:`write_recipe` the row's environment recipe; ``python -m
tests.real.swebench_data pack|recipe MIRROR ROWS.json INSTANCE_ID`` adds a row.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1] / "fixtures" / "swebench"
ROWS = HERE / "rows.json"
# no attribute may change bytes on the way out or back in: the tree must hash the same
ATTRIBUTES = "* -text -export-subst -export-ignore -filter -ident\n"
GIT_ENV = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "LANG": "C", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def rows() -> dict[str, dict[str, Any]]:
    return {row["instance_id"]: row for row in json.loads(ROWS.read_text())}


def slug(row: dict[str, Any]) -> str:
    return f"{row['repo'].replace('/', '__')}-{row['base_commit'][:12]}"


def _git(git_dir: Path | str, *args: str, stdin: bytes | None = None, work: Path | None = None) -> bytes:
    extra = ["--work-tree", str(work)] if work else []
    done = subprocess.run(["git", "--git-dir", str(git_dir), *extra, *args], input=stdin, capture_output=True,
                          env=GIT_ENV, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.decode()[-800:]}")
    return done.stdout


def _plain_git_dir(dest: Path, objects_from: Path | None = None) -> Path:
    """A bare repository whose attributes turn every conversion off (and that borrows
    ``objects_from``'s objects when given)."""
    subprocess.run(["git", "init", "-q", "--bare", str(dest)], check=True, env=GIT_ENV)
    (dest / "info").mkdir(exist_ok=True)
    (dest / "info" / "attributes").write_text(ATTRIBUTES)
    if objects_from:
        (dest / "objects" / "info" / "alternates").write_text(str(objects_from / "objects") + "\n")
    return dest


def pack(mirror: Path, row: dict[str, Any], out: Path = HERE / "repos") -> Path:
    """``<slug>.tar.xz`` (the tree) and ``<slug>.commit`` (the raw commit) from a full clone."""
    out.mkdir(parents=True, exist_ok=True)
    commit = row["base_commit"]
    with tempfile.TemporaryDirectory() as tmp:
        git_dir = _plain_git_dir(Path(tmp) / "g.git", mirror if (mirror / "objects").is_dir() else mirror / ".git")
        tree = _git(git_dir, "archive", "--format=tar", commit)
        raw = _git(git_dir, "cat-file", "commit", commit)
    tarball = out / f"{slug(row)}.tar.xz"
    tarball.write_bytes(subprocess.run(["xz", "-9e", "-T1", "-c"], input=tree, capture_output=True, check=True).stdout)
    (out / f"{slug(row)}.commit").write_bytes(raw)
    return tarball


def materialize(row: dict[str, Any], dest: Path) -> Path:
    """A git repository at ``dest`` (work tree and ``.git``) holding exactly the row's
    ``base_commit``, checked out; shallow, as a ``--depth 1`` clone."""
    tarball = HERE / "repos" / f"{slug(row)}.tar.xz"
    raw = (HERE / "repos" / f"{slug(row)}.commit").read_bytes()
    dest.mkdir(parents=True)
    git_dir = _plain_git_dir(dest / ".git")
    _git(git_dir, "config", "core.bare", "false")
    subprocess.run(["tar", "-xJf", str(tarball), "-C", str(dest), "--no-same-owner"], check=True)
    _git(git_dir, "add", "-A", "-f", ".", work=dest)
    tree = _git(git_dir, "write-tree").decode().strip()
    expected = raw.split(b"\n", 1)[0].decode().split(" ", 1)[1]
    if tree != expected:
        raise RuntimeError(f"{slug(row)}: unpacked tree {tree} is not the commit's tree {expected}")
    commit = _git(git_dir, "hash-object", "-t", "commit", "-w", "--stdin", stdin=raw).decode().strip()
    if commit != row["base_commit"]:
        raise RuntimeError(f"{slug(row)}: rebuilt commit {commit} is not {row['base_commit']}")
    (git_dir / "shallow").write_text(commit + "\n")
    _git(git_dir, "update-ref", "refs/heads/main", commit)
    _git(git_dir, "symbolic-ref", "HEAD", "refs/heads/main")
    return dest


def write_recipe(mirror: Path, row: dict[str, Any]) -> Path:
    """``recipes/<instance_id>.json``: the row's recipe from swebench's specs, its requirement
    files read at ``environment_setup_commit`` from a full clone (the shipped tree has only the
    base commit); the repository's path is set at test time."""
    from tasks.swe.env import recipe_for_row

    recipe = recipe_for_row(row, str(mirror))
    recipe = recipe.model_copy(update={"repo": recipe.repo.model_copy(update={"source": "(set at test time)"})})
    out = HERE / "recipes" / f"{row['instance_id']}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(recipe.model_dump_json(indent=1) + "\n")
    return out


USAGE = ("usage: python -m tests.real.swebench_data pack|recipe MIRROR_GIT_DIR ROWS.json INSTANCE_ID\n"
         "  pack: the tree and commit of the row's base_commit; recipe: its environment recipe")

if __name__ == "__main__":
    if sys.argv[1:2] in (["pack"], ["recipe"]) and len(sys.argv) == 5:
        table = {r["instance_id"]: r for r in json.loads(Path(sys.argv[3]).read_text())}
        act = pack if sys.argv[1] == "pack" else write_recipe
        print(act(Path(sys.argv[2]), table[sys.argv[4]]))
    else:
        sys.exit(USAGE)
