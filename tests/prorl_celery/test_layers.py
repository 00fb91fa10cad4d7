"""No import runs up the house: config < prorl_celery < sandboxes < tasks < flask_api.

Read from the sources (no module is imported): a module's top-level imports, those under
``if``/``try``/``with`` at the top included and ``if TYPE_CHECKING:`` excluded, name no room above
its own. ``prorl_celery/ops/`` is the composition root: it reaches up (the API, the sandbox host)
only inside the commands that start those parts, so its top level is held to the same rule.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.unit

HOUSE = ("config", "prorl_celery", "sandboxes", "tasks", "flask_api")  # lowest first


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported (not those inside functions or classes)."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        elif isinstance(stmt, ast.If):
            if not _type_checking(stmt.test):
                yield from _top_level_imports(stmt.body)
            yield from _top_level_imports(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody, *(h.body for h in stmt.handlers)):
                yield from _top_level_imports(block)
        elif isinstance(stmt, ast.With):
            yield from _top_level_imports(stmt.body)


def _imported(stmt: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(stmt, ast.Import):
        return [alias.name for alias in stmt.names]
    return [stmt.module] if stmt.level == 0 and stmt.module else []


def upward_imports() -> list[str]:
    """``path:line imports module`` for every top-level import of a room above the module's own."""
    found = []
    for rank, room in enumerate(HOUSE):
        for path in sorted((ROOT / room).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for stmt in _top_level_imports(tree.body):
                for name in _imported(stmt):
                    top = name.split(".")[0]
                    if top in HOUSE and HOUSE.index(top) > rank:
                        found.append(f"{path.relative_to(ROOT)}:{stmt.lineno} imports {name}")
    return found


def test_no_import_runs_up_the_house():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path):
    body = ast.parse("import os\nif TYPE_CHECKING:\n    from tasks import x\ntry:\n    from sandboxes.base import y\n"
                     "except ImportError:\n    pass\ndef f():\n    import flask_api\n").body
    assert [_imported(s) for s in _top_level_imports(body)] == [["os"], ["sandboxes.base"]]
