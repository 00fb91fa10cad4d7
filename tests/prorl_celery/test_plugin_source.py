"""A dotted path's class read from source: what it defines and inherits, found without importing
its module or any package above it (the package here ends the process if it is ever imported)."""
from __future__ import annotations

import sys
import textwrap

import pytest

from prorl_celery.errors import UnknownPlugin
from prorl_celery.plugin_source import class_members, find_spec

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

FILES = {
    "__init__.py": """
        from probepkg.base import Base as Exported
        raise SystemExit("probepkg was imported")
    """,
    "base.py": """
        class Base:
            def init(self, ctx): ...
            def run(self, ctx): ...
            eval = run
    """,
    "relative.py": """
        from .base import Base
        class Handler(Base):
            def extra(self): ...
    """,
    "dotted.py": """
        import probepkg.base
        from probepkg import base as b
        class ByModule(probepkg.base.Base): ...
        class ByAlias(b.Base): ...
    """,
    "rebound.py": """
        class Handler:
            def init(self, ctx): ...
        Handler = object()
    """,
    "__main__.py": """
        class Handler:
            def init(self, ctx): ...
    """,
}


@pytest.fixture
def probepkg(tmp_path, monkeypatch):
    package = tmp_path / "probepkg"
    package.mkdir()
    for name, text in FILES.items():
        (package / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    assert not [m for m in sys.modules if m.startswith("probepkg")]  # nothing was imported


def test_members_through_relative_and_dotted_bases(probepkg):
    assert {"init", "run", "eval", "extra"} <= class_members("probepkg.relative", "Handler", "handler")
    assert {"init", "run", "eval"} <= class_members("probepkg.dotted", "ByModule", "handler")
    assert {"init", "run", "eval"} <= class_members("probepkg.dotted", "ByAlias", "handler")
    assert {"init", "run", "eval"} <= class_members("probepkg", "Exported", "handler")  # re-exported
    assert find_spec("probepkg.relative").origin.endswith("relative.py")


@pytest.mark.parametrize("module,attr,why", [
    ("probepkg.__main__", "Handler", "never a __main__ module"),
    ("probepkg.rebound", "Handler", "defines no class"),  # the last binding is not a class
    ("probepkg.base", "Missing", "defines no class"),
    ("probepkg.nowhere", "Handler", "no Python source module"),
    ("probepkg.base", "not-an-identifier", "never a __main__ module"),
])
def test_what_the_source_does_not_show_is_refused(probepkg, module, attr, why):
    with pytest.raises(UnknownPlugin, match=why):
        class_members(module, attr, "handler")
