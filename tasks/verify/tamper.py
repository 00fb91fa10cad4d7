"""Which paths of a repository are tests or test infrastructure, and so not the model's to change.

A model patch that changes one of them (or a file the test patch touches) is *tampered*: the SWE
grader flags it and gives it no reward, since a changed ``conftest.py``, ``*.pth`` or pytest
section can turn any failure into a pass before a single test runs.
"""
from __future__ import annotations

import re
from pathlib import PurePosixPath

INFRA_NAMES = {"conftest.py", "pytest.ini", "tox.ini", "noxfile.py", "sitecustomize.py",
               "usercustomize.py", ".coveragerc", "unittest.cfg"}
TEST_DIRS = {"test", "tests", "testing"}
# Sections of shared config files that configure the test runner; the rest of the file is the
# model's to change (dependencies, metadata).
SECTIONED = {"setup.cfg": re.compile(r"^(tool:pytest|pytest|coverage:.*)$"),
             "pyproject.toml": re.compile(r"^tool\.(pytest|coverage)(\..*)?$")}
_HEADER = re.compile(r"^\s*\[+\s*([^\]]+?)\s*\]+\s*$")


def patch_paths(patch: str) -> set[str]:
    """Paths a unified diff touches (both sides of a rename), without the a/ b/ prefixes."""
    paths = set()
    for line in patch.splitlines():
        if line.startswith(("--- ", "+++ ")):
            name = line[4:].split("\t")[0].strip()
            if name != "/dev/null":
                paths.add(name[2:] if name[:2] in ("a/", "b/") else name)
    return paths


def is_test_path(path: str) -> bool:
    """Tests and test infrastructure by name alone."""
    parts = PurePosixPath(path).parts
    name = parts[-1] if parts else ""
    return (name in INFRA_NAMES or name.endswith(".pth") or any(p in TEST_DIRS for p in parts[:-1])
            or (name.endswith(".py") and (name.startswith("test_") or name[:-3].endswith("_test")
                                          or name == "tests.py")))


def test_sections(path: str, text: str) -> dict[str, str]:
    """The test-runner sections of a ``setup.cfg`` / ``pyproject.toml``, by header."""
    pattern = SECTIONED[PurePosixPath(path).name]
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1) if pattern.match(header.group(1)) else None
            if current:
                sections.setdefault(current, [])
        elif current:
            sections[current].append(line.rstrip())
    return {name: "\n".join(lines).strip() for name, lines in sections.items()}


def needs_sections(path: str) -> bool:
    return PurePosixPath(path).name in SECTIONED


def tampered(changed: set[str], test_patch: set[str], sections_changed: set[str]) -> list[str]:
    """The changed paths the model had no business changing. ``sections_changed``: the sectioned
    config files whose test sections differ from the base commit's."""
    return sorted(p for p in changed if p in test_patch or is_test_path(p) or p in sections_changed)
