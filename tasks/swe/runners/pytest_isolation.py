"""A pytest command the repository cannot redirect: the grader's runner, the grader's configuration.

:func:`rewrite` turns every ``pytest`` / ``python -m pytest`` of a test command into
:mod:`tasks.swe.runners.pytest_runner` (run from outside the repository, plugin autoload off, the
environment's plugins by name) with ``-c <config> --rootdir <root>``, where the config is the one
the *base commit* gave pytest, rewritten by :func:`base_config` into an ini file of the grader's
(what the patch left in ``pytest.ini``, ``.pytest.toml``, ``pyproject.toml`` ... is never read).

The base config is found as pytest finds one in the root: ``pytest.toml``, ``.pytest.toml``,
``pytest.ini``, ``.pytest.ini``, ``pyproject.toml`` (with a ``[tool.pytest.ini_options]`` or
``[tool.pytest]`` table), ``tox.ini`` (with ``[pytest]``), ``setup.cfg`` (with ``[tool:pytest]``).
"""
from __future__ import annotations

import re
import secrets
import shlex
import tomllib
from typing import Any, Callable

from tasks.swe.runners import command_rewrite
from tasks.swe.runners.base import RUNNERS_DIR, Isolated, RunSite, ScriptRunner, Start

CONFIG_NAMES = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini",
                "setup.cfg")
LINE_KEYS = {"markers", "filterwarnings"}  # read one entry per line; the rest are split like a shell
_SECTION = re.compile(r"^\s*\[\s*([^\]]+?)\s*\]\s*$")
_PYTEST = re.compile(command_rewrite.LEAD + rf"(?:({command_rewrite.PYTHON})\s+-m\s+pytest|pytest|py\.test)"
                     + command_rewrite.END)


def _ini_section(text: str, wanted: str) -> str | None:
    """The body of ``[wanted]`` in an ini text, verbatim (None when it has none)."""
    body, inside = [], False
    for line in text.splitlines():
        header = _SECTION.match(line)
        if header and not line.startswith((" ", "\t")):
            if inside:
                break
            inside = header.group(1) == wanted
            continue
        if inside:
            body.append(line)
    return "\n".join(body) if inside or body else None


def _ini_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        items = [str(v) for v in value] if key in LINE_KEYS else [shlex.quote(str(v)) for v in value]
        return "".join(f"\n    {item}" for item in items)
    return str(value).replace("\n", "\n    ")


def _from_toml(table: dict[str, Any]) -> str:
    return "\n".join(f"{key} = {_ini_value(key, value)}" for key, value in table.items()
                     if not isinstance(value, dict))


def _toml_table(name: str, text: str) -> dict[str, Any] | None:
    data = tomllib.loads(text)
    if name != "pyproject.toml":
        table = data.get("pytest")
        return table if isinstance(table, dict) else {}
    pytest_table = data.get("tool", {}).get("pytest")
    if not isinstance(pytest_table, dict):
        return None
    legacy = pytest_table.get("ini_options")
    return legacy if isinstance(legacy, dict) else pytest_table


def base_config(read: Callable[[str], str | None]) -> tuple[str | None, str]:
    """(the base file pytest would have read, the ini text that says the same). ``read(name)``
    gives a root file's text at the base commit, or None when the base has no such file."""
    for name in CONFIG_NAMES:
        text = read(name)
        if text is None:
            continue
        try:
            if name.endswith(".toml"):
                table = _toml_table(name, text)
                body = None if table is None else _from_toml(table)
            else:
                body = _ini_section(text, {"setup.cfg": "tool:pytest"}.get(name, "pytest"))
                body = "" if body is None and name.endswith("pytest.ini") else body
        except (tomllib.TOMLDecodeError, ValueError, AttributeError):
            body = None
        if body is not None:
            return name, f"[pytest]\n{body}\n"
    return None, "[pytest]\n"


def rewrite(command: str, runner: Callable[[str, int], str]) -> tuple[str, int]:
    """(``command`` with each pytest invocation replaced by ``runner(python, index)``, how many)."""
    return command_rewrite.rewrite(command, _PYTEST, runner, "python3")


class PytestRunner(ScriptRunner):
    """Each pytest run replaced by :mod:`tasks.swe.runners.pytest_runner`, with the base commit's
    configuration (:func:`base_config`) in a file of the grader's beside the repository."""

    kind = "pytest-isolated"
    name = "pytest"
    script = RUNNERS_DIR / "pytest_runner.py"
    errors_once = False
    note = ("outcomes parsed from the test log, cross-checked with the isolated pytest runner's own "
            "report; the code under test still runs in the test process")

    def rewrite(self, command: str, start: Start) -> tuple[str, int]:
        return rewrite(command, start)

    def isolate(self, command: str, site: RunSite) -> Isolated | None:
        config = f"{site.root.rstrip('/')}/.prorl-pytest-{secrets.token_hex(6)}.ini"
        extra = f" -c {shlex.quote(config)} --rootdir {shlex.quote(site.root)}"
        command, count = self.rewrite(command, site.starter(self.name, extra))
        if not count:
            return None
        source, text = base_config(site.at_base)
        site.box.write_file(config, text.encode())
        site.install(self.name, self.script)
        return command, {"kind": self.kind, "config_from": source, "plugin_autoload": False}
