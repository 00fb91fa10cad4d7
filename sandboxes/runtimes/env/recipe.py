"""An environment recipe (:class:`EnvRecipe`), its key and its build script; built by
:mod:`sandboxes.runtimes.env.build`."""
from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prorl_celery.errors import EnvBuildFailed  # noqa: F401 - importable here, as before

BUILDER = "1"  # bumped whenever the build's steps change what an image holds: a new key
PIP_VERSION = "26.3"  # the first with --uploaded-prior-to is 26.x
SEED_PACKAGES = ("setuptools==69.5.1", "wheel==0.43.0")  # what a fresh conda Python (SWE-bench's) comes with


class RepoAt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="A git directory (bare or not) holding commit, or a .tar[.xz] of the tree.")
    commit: str = Field(description="The commit whose tree is installed (part of the key; the source path is not).")


class EnvRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("", description="A label for people; not part of the key.")
    python: str = Field("3", description="The Python the node's python3 must be (a version prefix, e.g. 3.11).")
    pip_packages: list[str] = Field([], description="Requirement specifiers installed first (pins).")
    requirements: list[str] = Field([], description="Lines of a requirements file, installed with -r.")
    pre_install: list[str] = Field([], description="Shell commands run in workdir before any install.")
    install: list[str] = Field([], description="Shell commands run in workdir last, e.g. 'python -m pip install -e .'.")
    repo: RepoAt | None = Field(None, description="The repository tree bound at workdir during the build.")
    workdir: str = Field("/workspace/repo", description="Where the repository is in the build and in every sandbox.")
    env: dict[str, str] = Field({}, description="Variables of the build (e.g. SETUPTOOLS_SCM_PRETEND_VERSION).")
    uploaded_prior_to: str | None = Field(None, description="ISO date: every pip resolution of the recipe (build "
                                          "dependencies too) sees PyPI as it stood then, so unpinned "
                                          "requirements get what they got when the recipe was written.")
    notes: dict[str, Any] = Field({}, description="Provenance (e.g. what the specs asked for); not part of the key.")

    def key(self, base: str) -> str:
        body = self.model_dump(exclude={"name", "notes"})
        body["repo"] = self.repo.commit if self.repo else None
        text = json.dumps({"recipe": body, "base": base, "pip": PIP_VERSION, "seed": SEED_PACKAGES,
                           "builder": BUILDER}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]


def _pinned(requirement: str) -> bool:
    return "==" in requirement and not any(c in requirement for c in "<>!~,;")


def script(recipe: EnvRecipe, pip_wheel: str) -> str:
    """The build's shell script (pure), in SWE-bench's order: requirements, pinned packages, then
    ``pre_install`` and ``install`` in the repository. ``uploaded_prior_to`` holds for every pip
    resolution but the exact pins (``name==version``), which name what they get already."""
    lines = ["set -euo pipefail", "mkdir -p /usr/local/bin", "ln -sf /usr/bin/python3 /usr/local/bin/python",
             f"python3 {shlex.quote(pip_wheel)}/pip install -q --no-index {shlex.quote(pip_wheel)}",
             "python3 -m pip install -q " + " ".join(SEED_PACKAGES)]
    pins = [p for p in recipe.pip_packages if _pinned(p)]
    if pins:
        lines.append("python3 -m pip install " + " ".join(shlex.quote(p) for p in pins))
    if recipe.uploaded_prior_to:
        lines.append(f"export PIP_UPLOADED_PRIOR_TO={shlex.quote(recipe.uploaded_prior_to)}")
    if recipe.requirements:
        lines.append("printf '%s\\n' " + " ".join(shlex.quote(r) for r in recipe.requirements) + " > /tmp/requirements.txt")
        lines.append("python3 -m pip install -r /tmp/requirements.txt")
    loose = [p for p in recipe.pip_packages if not _pinned(p)]
    if loose:
        lines.append("python3 -m pip install " + " ".join(shlex.quote(p) for p in loose))
    lines += [f"cd {shlex.quote(recipe.workdir)}", *recipe.pre_install, *recipe.install]
    return "\n".join([*lines, "python3 -m pip freeze > /usr/local/prorl-freeze.txt", ""])
