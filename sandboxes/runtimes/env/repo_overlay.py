"""Modules an environment's install generated inside the repository, served from the image.

An install such as ``pip install -e .`` may write files into the repository it installs
(setuptools-scm's ``_version.py``); SWE-bench's images keep them in their one checkout. Here
every sandbox checks out the repository afresh, so the build keeps those files in the image
(``OVERLAY``, by their path in the repository), and this finder, appended to ``sys.meta_path``
by a ``.pth`` file of the environment, serves a module from there only when the checkout itself
has no such module. Nothing is written into the checkout. This file is copied into the image
as it is: it imports nothing of the project.
"""
from __future__ import annotations

import importlib.util
import os
import sys

OVERLAY = "/usr/local/lib/prorl-repo-overlay"
WORKDIR = "/workspace/repo"


class RepoOverlayFinder:
    """A meta path finder consulted after every other one (see module doc)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        leaf = fullname.rpartition(".")[2]
        for entry in list(path) if path is not None else sys.path:
            entry = os.path.abspath(entry or os.getcwd())
            if not (entry == WORKDIR or entry.startswith(WORKDIR + os.sep)):
                continue
            base = os.path.join(OVERLAY, os.path.relpath(entry, WORKDIR), leaf)
            for candidate, is_package in ((base + ".py", False), (os.path.join(base, "__init__.py"), True)):
                if os.path.isfile(candidate):
                    return importlib.util.spec_from_file_location(
                        fullname, candidate, submodule_search_locations=[os.path.dirname(candidate)] if is_package else None)
        return None


def install() -> None:
    if not any(isinstance(f, type) and f.__name__ == "RepoOverlayFinder" for f in sys.meta_path):
        sys.meta_path.append(RepoOverlayFinder)


if os.path.isdir(OVERLAY):
    install()
