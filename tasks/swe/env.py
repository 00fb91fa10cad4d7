"""An environment recipe for a SWE-bench row, from the ``swebench`` package's own specs.

SWE-bench builds a conda environment per (repo, version) — ``python``, ``packages`` (conda
names, a ``requirements.txt`` read from the repository at ``environment_setup_commit``, or an
``environment.yml``), ``pip_packages`` — and then runs ``pre_install`` and ``install`` in the
repository at ``base_commit``. :func:`recipe_for_row` turns that into an
:class:`~sandboxes.runtimes.env.recipe.EnvRecipe` on this node's Python (the node has one
python3; the version the specs asked for is kept in ``notes``): conda package names are
installed with pip, requirement files with ``pip install -r``; ``environment.yml`` specs are
refused (they need conda). The tree is installed without its history, so a project versioned by
setuptools-scm gets the row's ``version`` (``SETUPTOOLS_SCM_PRETEND_VERSION``). The specs pin
some packages and leave others open; open ones resolve against PyPI as it stood when the row was
made (pip's ``--uploaded-prior-to``), not as it stands today (today's pytest no longer runs a
2020 test suite's nose-style ``setup`` methods).

The specs are swebench's ``MAP_REPO_VERSION_TO_SPECS`` (Python part) and
``MAP_REPO_TO_REQS_PATHS``, unless the caller passes ``specs``: read from the installed package
when it has them (2.x-4.x), else from the swebench 4.1.0 wheel (5.x dropped the table; its rows
name prebuilt images instead), which pip downloads once into the environment cache. Only that
one data file of the wheel is read; nothing of swebench is imported.

CLI: ``python -m tasks.swe.env build ROW.json --repo DIR`` builds the row's environment with the
generic builder (:func:`sandboxes.runtimes.env.build.run`) and prints its image directory; ``key``
prints where it would be.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prorl_celery.errors import EnvBuildFailed
from sandboxes.runtimes.env.recipe import EnvRecipe, RepoAt

ReadFile = Callable[[str, str], str | None]
SKIPPED_LINES = ("-e .", "#", ".[test")  # as SWE-bench's own requirements reader
REPLACED = {"types-pkg_resources": "types-setuptools"}  # yanked from PyPI; SWE-bench swaps it too
# when each Python had wheels for most of PyPI (its first x.y.0 release plus a few months)
PYTHON_WHEELS_FROM = {"3.9": "2021-01-01", "3.10": "2022-01-01", "3.11": "2023-04-01",
                      "3.12": "2024-03-01", "3.13": "2025-03-01"}
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


SPECS_RELEASE = "4.1.0"  # the last swebench release that ships MAP_REPO_VERSION_TO_SPECS
SPECS_MEMBER = "swebench/harness/constants/python.py"  # plain data, imports nothing


def _exec_tables(source: str, origin: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "swebench_specs_tables", "__file__": origin}
    exec(compile(source, origin, "exec"), namespace)  # noqa: S102 - swebench's own table, data only
    return namespace


@functools.lru_cache(maxsize=1)
def specs_tables() -> dict[str, Any]:
    """swebench's Python spec tables: from the installed package when it has them (4.x), else
    from the swebench 4.1.0 wheel (``SPECS_RELEASE``), downloaded once by pip into the environment cache."""
    found = importlib.util.find_spec("swebench")
    if found and found.origin:
        installed = Path(found.origin).parent / "harness" / "constants" / "python.py"
        if installed.is_file() and "MAP_REPO_VERSION_TO_SPECS_PY" in installed.read_text():
            return _exec_tables(installed.read_text(), str(installed))
    from sandboxes.runtimes.env.build import env_dir

    wheels = env_dir() / "swebench-specs"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = next(iter(sorted(wheels.glob(f"swebench-{SPECS_RELEASE}-*.whl"))), None)
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                        f"swebench=={SPECS_RELEASE}"], capture_output=True, timeout=600)
        wheel = next(iter(sorted(wheels.glob(f"swebench-{SPECS_RELEASE}-*.whl"))), None)
    if wheel is None:
        raise EnvBuildFailed(f"no swebench spec table: the installed swebench has none and pip could not "
                             f"download swebench=={SPECS_RELEASE}")
    with zipfile.ZipFile(wheel) as archive:
        return _exec_tables(archive.read(SPECS_MEMBER).decode(), f"{wheel}/{SPECS_MEMBER}")


def swebench_specs(repo: str, version: str) -> dict[str, Any]:
    try:
        return dict(specs_tables()["MAP_REPO_VERSION_TO_SPECS_PY"][repo][str(version)])
    except KeyError:
        raise EnvBuildFailed(f"swebench has no specs for {repo} version {version}") from None


def swebench_reqs_paths(repo: str) -> list[str]:
    return list(specs_tables().get("MAP_REPO_TO_REQS_PATHS", {}).get(repo, []))


def git_reader(repo_dir: str) -> ReadFile:
    """Read ``path`` at ``commit`` from a git directory (None when either is missing)."""
    def read(commit: str, path: str) -> str | None:
        done = subprocess.run(["git", "-C", repo_dir, "show", f"{commit}:{path}"], capture_output=True, timeout=60)
        return done.stdout.decode() if done.returncode == 0 else None
    return read


def _replaced(line: str) -> str:
    found = _NAME.match(line)
    return REPLACED.get(found.group(1), line) if found else line


def requirement_lines(read: ReadFile, commit: str, paths: list[str]) -> tuple[list[str], str]:
    """The lines of the first requirements file found, ``-r`` includes inlined (one level, as
    SWE-bench does); (lines, the path used)."""
    for path in paths:
        text = read(commit, path)
        if text is None:
            continue
        folder = path.rpartition("/")[0]
        included: list[str] = []
        own: list[str] = []
        for line in text.splitlines():
            if line.strip().startswith("-r"):
                name = line.strip()[2:].strip()
                extra = read(commit, f"{folder}/{name}" if folder else name) or ""
                included += [x for x in extra.splitlines() if not x.strip().startswith(SKIPPED_LINES)]
            elif not line.strip().startswith(SKIPPED_LINES):
                own.append(line)
        return [_replaced(x.strip()) for x in included + own if x.strip()], path
    raise EnvBuildFailed(f"none of {paths} exists at {commit}")


def _packages(specs: dict[str, Any], row: dict[str, Any], read: ReadFile | None,
              reqs_paths: list[str] | None) -> tuple[list[str], dict[str, Any]]:
    packages = specs.get("packages", "")
    if packages == "environment.yml":
        raise EnvBuildFailed(f"{row['repo']} {row['version']}: the specs need conda (environment.yml)")
    if packages != "requirements.txt":
        return packages.split(), {}
    if read is None:
        raise EnvBuildFailed(f"{row['repo']}: the specs read requirements from the repository; give it")
    commit = row.get("environment_setup_commit") or row["base_commit"]
    paths = reqs_paths if reqs_paths is not None else swebench_reqs_paths(row["repo"])
    try:
        lines, used = requirement_lines(read, commit, paths)
    except EnvBuildFailed:
        commit = row["base_commit"]  # a mirror without the setup commit: the base's own file
        lines, used = requirement_lines(read, commit, paths)
    return lines, {"requirements_from": f"{used}@{commit}"}


def cutoff(row: dict[str, Any], python: str) -> str | None:
    """When PyPI is read for the row: when the row was made, but no earlier than ``python`` had
    wheels (an older index has none for it, so sdists would be built, and fail, instead)."""
    made = str(row.get("created_at") or "")[:10]
    floor = PYTHON_WHEELS_FROM.get(python, "")
    return max(made, floor) or None


def recipe_for_row(row: dict[str, Any], repo: str | None, specs: dict[str, Any] | None = None,
                   reqs_paths: list[str] | None = None, python: str = "3.11") -> EnvRecipe:
    """The recipe of ``row`` (``repo``, ``version``, ``base_commit``, ``created_at``) on ``python``
    (the node's), installing from ``repo`` (a git directory or a tar of the tree at
    ``base_commit``), if given; unpinned requirements resolve as of :func:`cutoff`."""
    specs = dict(specs) if specs is not None else swebench_specs(row["repo"], row["version"])
    read = git_reader(repo) if repo and not repo.endswith((".tar", ".tar.xz", ".tar.gz")) else None
    requirements, notes = _packages(specs, row, read, reqs_paths)
    install = specs.get("install")
    return EnvRecipe(
        name=f"{row['repo']}@{row['version']}:{row['instance_id']}",
        python=python, requirements=requirements, pip_packages=list(specs.get("pip_packages", [])),
        pre_install=list(specs.get("pre_install", [])), install=[install] if install else [],
        repo=RepoAt(source=repo, commit=row["base_commit"]) if repo else None,
        # the tree comes without .git: setuptools-scm projects get the row's version instead
        env={"SETUPTOOLS_SCM_PRETEND_VERSION": str(row["version"])}, uploaded_prior_to=cutoff(row, python),
        notes={"swebench_specs": json.loads(json.dumps(specs, default=str)),
               "python_requested": specs.get("python"), **notes})


def main(argv: list[str] | None = None) -> int:
    from sandboxes.runtimes.env import build

    parser = argparse.ArgumentParser(prog="python -m tasks.swe.env",
                                     description="The environment of a SWE-bench row, from the swebench specs.")
    parser.add_argument("command", choices=build.COMMANDS)
    parser.add_argument("row", help="A SWE-bench row (JSON).")
    parser.add_argument("--repo", help="The repository to install from (git directory or tree tar).")
    args = parser.parse_args(argv)
    row = json.loads(Path(args.row).read_text())
    return build.run(args.command, recipe_for_row(row, args.repo, python=build.node_python()))


if __name__ == "__main__":
    sys.exit(main())
