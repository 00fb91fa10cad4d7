"""How a SWE instance's tests run and how their log is read: SWE-bench's own knowledge where the
instance is one of its rows, the project's parser (:mod:`tasks.swe.test_log`) otherwise.

The test command, first found wins:

1. the instance's ``test_cmd`` (the project's field);
2. the instance's ``eval_script`` (rows of the datasets that ``swebench`` 5.x reads carry their
   own): the lines between its ``>>>>> Start Test Output`` and ``>>>>> End Test Output`` markers,
   after its environment lines (``source``, ``conda activate``, ``export``); its resets and patch
   steps are left out, the grader does those itself;
3. ``MAP_REPO_VERSION_TO_SPECS[repo][version]["test_cmd"]`` where the installed ``swebench`` has
   that table (4.x; 5.x dropped it), with the test files of the test patch as arguments;
4. the runner SWE-bench uses for the repository: Django's ``tests/runtests.py`` with module
   names, SymPy's ``bin/test``, else ``pytest -rA`` on the test patch's files.

The parser: the instance's ``log_parser`` (a name in ``swebench``'s ``PARSER_REGISTRY``, or
``prorl``), else the one ``swebench`` maps the ``repo`` to (``MAP_REPO_TO_PARSER`` in 4.x, the
``MAP_REPO_TO_PARSER_<LANG>`` tables of 5.x), else ``prorl``. SWE-bench's pytest parsers keep
only the first word of an id with spaces; the ids such a log holds in full (read by ``prorl``)
are added beside them, and :func:`tasks.swe.test_log.lookup` matches a listed id either way.

``swebench`` is imported on first use, never by the API: its ``swebench.harness`` package
imports docker, modal and datasets (about 1,700 modules, 6 s) although the parsers need ``re``
only, so :func:`_swebench` reads ``harness/constants`` and ``harness/log_parsers`` beneath an
empty ``swebench.harness`` package when nothing imported the real one yet.
"""
from __future__ import annotations

import functools
import importlib
import importlib.machinery
import os
import re
import shlex
import sys
import types
from typing import Any, Callable, Literal

from pydantic import BaseModel, Field

from tasks.swe import test_log

PRORL = "prorl"
PYTEST = "python3 -m pytest -rA -p no:cacheprovider"
DJANGO = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
SYMPY = "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose"
START, END = ">>>>> Start Test Output", ">>>>> End Test Output"
_NOT_TESTS = (".json", ".txt", ".md", ".rst", ".yml", ".yaml", ".toml", ".cfg", ".ini", ".png",
              ".svg", ".csv", ".html", ".xml", ".lock")
_ENV_LINE = re.compile(r"^\s*(source\s|\.\s|conda\s+activate\s|export\s)")
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
_DIFF_TARGET = re.compile(r"^diff --git a/\S+ b/(\S+)$", re.M)


class SweSpec(BaseModel):
    """How one instance's tests run and are read."""

    test_cmd: str = Field(description="Runs in the repository's root; its output is the test log.")
    setup: list[str] = Field(default_factory=list,
                             description="Shell lines run before it in the same shell (environment activation).")
    parser: str = Field(PRORL, description="'prorl', or the name of a parser in swebench's PARSER_REGISTRY.")
    source: Literal["instance", "eval_script", "swebench", "default"] = Field(
        description="Where test_cmd came from (see the module docstring).")
    swebench: str | None = Field(None, description="The installed swebench version, when it was asked.")


# -- swebench, lazily ---------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _swebench() -> types.SimpleNamespace | None:
    """swebench's parser registry, repo -> parser table and spec table (None where absent)."""
    if importlib.util.find_spec("swebench") is None:
        return None
    import swebench

    if "swebench.harness" not in sys.modules:  # 5.x: swebench/__init__ is light, harness is not
        path = os.path.join(os.path.dirname(swebench.__file__), "harness")
        spec = importlib.machinery.ModuleSpec("swebench.harness", None, is_package=True)
        spec.submodule_search_locations = [path]
        hollow = importlib.util.module_from_spec(spec)
        sys.modules["swebench.harness"] = hollow
        swebench.harness = hollow
    constants = importlib.import_module("swebench.harness.constants")
    parsers = importlib.import_module("swebench.harness.log_parsers")
    by_repo = dict(getattr(parsers, "MAP_REPO_TO_PARSER", {}))
    for name, module in list(sys.modules.items()):  # 5.x: one MAP_REPO_TO_PARSER_<LANG> per language
        if name.startswith("swebench.harness.log_parsers."):
            for attr in (a for a in dir(module) if a.startswith("MAP_REPO_TO_PARSER_")):
                by_repo.update(getattr(module, attr))
    registry = dict(getattr(parsers, "PARSER_REGISTRY", {}))
    for fn in by_repo.values():
        registry.setdefault(fn.__name__, fn)
    return types.SimpleNamespace(version=getattr(swebench, "__version__", "?"), registry=registry,
                                 by_repo=by_repo, specs=getattr(constants, "MAP_REPO_VERSION_TO_SPECS", {}))


def swebench_version() -> str | None:
    sb = _swebench()
    return sb.version if sb else None


def _parser_name(instance: dict[str, Any]) -> str:
    asked = instance.get("log_parser")
    sb = _swebench()
    if asked == PRORL or sb is None:
        return PRORL
    if isinstance(asked, str) and asked in sb.registry:
        return asked
    fn = sb.by_repo.get(instance.get("repo"))
    if fn is None:
        return PRORL
    return next((name for name, known in sb.registry.items() if known is fn), fn.__name__)


def parser(name: str) -> Callable[[str, Any], dict[str, str]] | None:
    """swebench's parser called ``name`` (None for ``prorl`` or a name it does not know)."""
    sb = _swebench()
    return None if name == PRORL or sb is None else sb.registry.get(name)


# -- the test command ---------------------------------------------------------------------
def test_files(test_patch: str) -> list[str]:
    """The files a test patch adds or changes, less data files (SWE-bench's test directives)."""
    return [path for path in dict.fromkeys(_DIFF_TARGET.findall(test_patch or ""))
            if not path.endswith(_NOT_TESTS)]


def _directives(repo: str, test_patch: str) -> list[str]:
    files = test_files(test_patch)
    if repo == "django/django":  # runtests.py takes dotted module names beneath tests/
        return [re.sub(r"^tests/", "", f[:-3] if f.endswith(".py") else f).replace("/", ".") for f in files]
    return files


def from_eval_script(script: str) -> tuple[list[str], str] | None:
    """(environment lines, test command) of a SWE-bench eval script, or None without markers."""
    lines = script.splitlines()
    start = next((i for i, line in enumerate(lines) if START in line), None)
    end = next((i for i, line in enumerate(lines) if END in line and start is not None and i > start), None)
    if start is None or end is None:
        return None
    command = "\n".join(line for line in lines[start + 1:end] if line.strip())
    return _setup_lines(lines[:start]), command


def _setup_lines(lines: list[str]) -> list[str]:
    """The environment lines of an eval script's head, each once (a heredoc's lines are skipped)."""
    setup, heredoc = [], None
    for line in lines:
        if heredoc is not None:  # a patch fed to git apply: its lines are data
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        opened = _HEREDOC.search(line)
        if opened:
            heredoc = opened.group(1)
        elif _ENV_LINE.match(line):
            setup.append(line.strip())
    return list(dict.fromkeys(setup))


def _with_files(command: str, files: list[str]) -> str:
    return " ".join([command, *(shlex.quote(f) for f in files)])


def spec_for(instance: dict[str, Any]) -> SweSpec:
    """The :class:`SweSpec` of ``instance`` (see the module docstring for the order)."""
    repo, version = instance.get("repo") or "", str(instance.get("version") or "")
    parser_name = _parser_name(instance)
    common = {"parser": parser_name, "swebench": swebench_version()}
    if instance.get("test_cmd"):
        return SweSpec(test_cmd=instance["test_cmd"], source="instance", **common)
    found = from_eval_script(instance["eval_script"]) if instance.get("eval_script") else None
    if found and found[1]:
        return SweSpec(test_cmd=found[1], setup=found[0], source="eval_script", **common)
    files = _directives(repo, instance.get("test_patch", ""))
    sb = _swebench()
    known = (sb.specs.get(repo) or {}).get(version) if sb else None
    if known and known.get("test_cmd"):
        cmd = known["test_cmd"]
        return SweSpec(test_cmd=_with_files(cmd if isinstance(cmd, str) else " && ".join(cmd), files),
                       setup=list(known.get("eval_commands") or []), source="swebench", **common)
    runner = {"django/django": DJANGO, "sympy/sympy": SYMPY}.get(repo, PYTEST)
    return SweSpec(test_cmd=_with_files(runner, files), source="default", **common)


# -- reading the log ----------------------------------------------------------------------
def _status(value: Any) -> str:
    word = getattr(value, "value", value)
    return {"XFAIL": test_log.PASSED, "XPASS": test_log.FAILED}.get(str(word), str(word))


def parse(spec: SweSpec, log: str, instance: dict[str, Any] | None = None) -> dict[str, str]:
    """Outcomes by test name from ``log``, read as ``spec`` says."""
    ours = test_log.parse(log)
    fn = parser(spec.parser)
    if fn is None:
        return ours
    outcomes = {str(k): _status(v) for k, v in fn(log, _test_spec(spec, instance or {})).items()}
    outcomes.update({k: v for k, v in ours.items() if any(c.isspace() for c in k)})
    return outcomes


def _test_spec(spec: SweSpec, instance: dict[str, Any]) -> Any:
    """The ``test_spec`` argument swebench's parsers take (most of them ignore it)."""
    try:
        from swebench.types import TestSpec
    except ImportError:
        return None
    try:
        return TestSpec(instance_id=str(instance.get("instance_id", "")), image="", eval_script_list=[],
                        repo=str(instance.get("repo", "")), version=str(instance.get("version", "")),
                        FAIL_TO_PASS=[], PASS_TO_PASS=[], log_parser=spec.parser)
    except TypeError:
        return None
