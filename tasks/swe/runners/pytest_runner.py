"""Runs pytest so that the repository cannot stand in for the runner or bring plugins (standard
library and the environment's pytest only; the SWE grader copies it into the sandbox).

    python3 pytest_runner.py NONCE_FILE ROOT PYTEST_ARGS...   (in the repository's root)

- Run as a script from outside the repository, so the repository's root is not the first entry
  of ``sys.path`` (``python -m pytest`` puts the working directory first: a ``pytest.py`` or
  ``_pytest/`` at the root would be the runner): it goes last, behind the standard library and
  the environment; this file's own directory is dropped.
- ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``, ``PYTEST_ADDOPTS`` and ``PYTEST_PLUGINS`` cleared; the
  ``pytest11`` plugins of distributions installed *outside* the repository (the environment the
  base tree was built with) are loaded by name with ``-p``; a ``*.dist-info`` in the tree is not.
- The grader passes the configuration it wrote (``-c``, ``--rootdir``) among the arguments;
  ``--maxfail=0`` goes last, so that a planted must-fail canary never ends the run early;
  ``--no-cov`` is added where the environment's pytest-cov would trace the run.
- The test files the arguments name (each with the files of its directory, a named directory
  whole) are read before pytest or the repository is imported, and the watch of
  :mod:`tasks.swe.runners.run_watch` (copied beside this script) is started: before each test is
  called its function is checked against the code compiled from those sources (plain, and with
  pytest's assertion rewrite), and a profile or trace hook or a test's ``__code__`` replaced is
  noted. pytest's own machinery (``_pytest.runner``, ``python``, ``reports``, ``unittest`` ...)
  and this file's functions are snapshot before the run: what differs after is ``changed``.
- Each test's outcome is recorded by a plugin of this file, printed last as one line
  ``<nonce> <json>`` on a copy of stdout taken before any of the repository is imported, then the
  process ends with ``os._exit`` (no ``atexit`` hook of the package runs after it). The grader
  cross-checks the log's outcomes with this report; the nonce file is deleted once read.

The code under test still runs in this process: it can rewrite reports (the grader's canaries
catch a blanket rewrite) or find this module's objects in memory; that it cannot be prevented here.
"""
from __future__ import annotations

import ast
import builtins
import json
import os
import sys

_EXIT = os._exit  # the package may replace os._exit (to let its atexit hooks run)
_COMPILE = builtins.compile
# pytest's machinery a package could patch in process (snapshot before the run, compared after)
MACHINERY = ("_pytest.runner", "_pytest.python", "_pytest.reports", "_pytest.unittest", "_pytest.skipping",
             "_pytest.main", "_pytest.outcomes", "_pytest.terminal", "_pytest.fixtures", "pluggy._callers",
             "pluggy.callers", "pluggy._hooks", "pluggy.hooks", "unittest.case", "unittest.result", "unittest.suite")

_RANK = {"PASSED": 0, "SKIPPED": 1, "FAILED": 2, "ERROR": 2}


def _path_for(root: str) -> None:
    """This file's directory off ``sys.path``; the root last, behind the standard library and the
    environment (``python -m pytest`` would put it first; a repository that is not installed
    still imports its package from there)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") not in (here, os.path.abspath(root))]
    sys.path.append(os.path.abspath(root))


def _env_plugins(root: str) -> list[str]:
    """Entry-point names of the ``pytest11`` plugins installed outside ``root``."""
    import importlib.metadata as metadata

    names: list[str] = []
    prefix = os.path.realpath(root) + os.sep
    for dist in metadata.distributions():
        where = os.path.realpath(str(dist.locate_file(""))) + os.sep
        if where.startswith(prefix):
            continue
        for ep in dist.entry_points:
            if ep.group == "pytest11" and ep.name not in names:
                names.append(ep.name)
    return names


def coverage_off(plugins: list[str]) -> list[str]:
    """``--no-cov`` where the environment's pytest-cov would trace the run (a ``--cov`` in the base
    configuration): a trace hook is what the watch reports, and coverage changes no outcome."""
    if "pytest_cov" not in plugins:
        return []
    import importlib.metadata as metadata

    try:
        version = tuple(int(p) for p in metadata.version("pytest-cov").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-cov"] if version >= (2, 4) else []


def load_watch():
    """:mod:`tasks.swe.runners.run_watch`, loaded by path from beside this script (the grader copies
    it there as ``.prorl-run-watch.py``), never through ``sys.path``."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for name in (".prorl-run-watch.py", "run_watch.py"):
        path = os.path.join(here, name)
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("prorl_run_watch", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise SystemExit(f"the grader's run_watch.py is not beside {__file__}")


def test_paths(args: list[str]) -> list[str]:
    """The files the arguments name, with the other files of their directories (a base class, a
    helper), and the directories they name, whole."""
    paths = []
    for arg in args:
        path = arg.split("::", 1)[0]
        if arg.startswith("-") or not os.path.exists(path):
            continue
        if os.path.isdir(path):
            paths.append(path)
            continue
        folder = os.path.dirname(os.path.abspath(path))
        paths += [path] + [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".py")]
    return paths


def snapshot() -> list[tuple[object, dict]]:
    owners: list = []
    for name in MACHINERY:
        module = sys.modules.get(name)
        if module is not None:
            owners += [module] + [v for v in vars(module).values()
                                  if isinstance(v, type) and getattr(v, "__module__", "") == name]
    return [(owner, dict(vars(owner))) for owner in owners]


def changed(saved: list[tuple[object, dict]], mine: dict) -> list[str]:
    """The snapshot's functions and classes (a class's attributes, new ones too) that differ now,
    and this script's."""
    names = []
    for owner, attrs in saved:
        current, label = vars(owner), getattr(owner, "__qualname__", getattr(owner, "__name__", "?"))
        if isinstance(owner, type):
            names += [f"{label}.{n}" for n, v in current.items() if n not in attrs and callable(v)]
        names += [f"{label}.{n}" for n, v in attrs.items() if callable(v) and current.get(n) is not v]
    here = globals()
    names += [f"runner.{n}" for n, v in mine.items() if here.get(n) is not v]
    return sorted(set(names))


def owners(item, name: str, pytest) -> list[tuple[str, str]]:
    """(file, scope) where ``item``'s function was found at run time, then its class's bases."""
    path = str(getattr(item, "path", None) or getattr(item, "fspath", ""))
    cls = getattr(item, "cls", None)
    if cls is None:
        return [(path, "")]
    scope = ".".join(node.name for node in item.listchain() if isinstance(node, pytest.Class))
    mro = [k for k in getattr(cls, "__mro__", (cls,)) if k is not object]

    def where(klass) -> tuple[str, str]:
        if klass is cls:
            return path, scope
        module = sys.modules.get(getattr(klass, "__module__", ""))
        return str(getattr(module, "__file__", "") or ""), getattr(klass, "__qualname__", "")
    owner = next((k for k in mro if name in vars(k)), cls)
    return [where(owner)] + [where(k) for k in mro if k is not owner]


def rewriter(config):
    """How pytest compiles a test module it rewrites (from a source read before the package
    loaded), or None when it rewrites none."""
    try:
        from _pytest.assertion import rewrite
        if config.getvalue("assertmode") != "rewrite":
            return None
    except (ImportError, ValueError, AttributeError):
        return None

    def compile_rewritten(source: bytes, path: str):
        tree = _COMPILE(source, path, "exec", ast.PyCF_ONLY_AST, True)
        try:
            rewrite.rewrite_asserts(tree, source, path, config)
        except TypeError:  # pytest < 5: no source argument
            rewrite.rewrite_asserts(tree, path, config)
        return _COMPILE(tree, path, "exec", 0, True)
    return compile_rewritten


class Record:
    """Each test's outcome as this process's pytest reported it (SWE-bench's reading: an
    expected failure passes, an unexpected pass fails, an error in setup or teardown is ERROR),
    and each test's function checked by the watch just before it is called."""

    def __init__(self, watch=None) -> None:
        self.outcomes: dict[str, str] = {}
        self.watch = watch
        self.saved: list[tuple[object, dict]] | None = None

    def pytest_load_initial_conftests(self, early_config, parser, args) -> None:
        """The machinery as the environment's plugins left it, before a conftest (which may
        import the package) is loaded."""
        self.saved = snapshot()

    def pytest_configure(self, config) -> None:
        if self.watch is not None:
            self.watch.rewrite = rewriter(config)

    def pytest_runtest_call(self, item) -> None:
        func = getattr(item, "obj", None) if self.watch is not None else None
        if func is None:
            return
        import pytest

        name = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
        try:
            where = owners(item, name, pytest)
        except Exception:  # noqa: BLE001 - a class the package made strange: checked as not found
            where = [("", "")]
        self.watch.check(item.nodeid, func, where, name)

    def _set(self, nodeid: str, status: str) -> None:
        if _RANK[status] >= _RANK.get(self.outcomes.get(nodeid, ""), -1):
            self.outcomes[nodeid] = status

    def pytest_runtest_logreport(self, report) -> None:
        xfail = hasattr(report, "wasxfail")
        if report.when == "call":
            if xfail:
                self._set(report.nodeid, "PASSED" if report.skipped else "FAILED")
            else:
                self._set(report.nodeid, {"passed": "PASSED", "failed": "FAILED"}.get(report.outcome, "SKIPPED"))
        elif report.failed:
            self._set(report.nodeid, "ERROR")
        elif report.skipped:
            self._set(report.nodeid, "PASSED" if xfail else "SKIPPED")


def main() -> int:
    nonce_file, root, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    with open(nonce_file) as fh:
        nonce = fh.read().strip()
    os.unlink(nonce_file)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    mine = {n: v for n, v in globals().items() if callable(v) and not n.startswith("__")}
    watch = load_watch().Watch(root)
    watch.read(test_paths(args))  # before pytest or the package is imported
    watch.start()
    _path_for(root)
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        os.environ.pop(name, None)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    plugins = _env_plugins(root)
    import pytest

    facts = {"pytest": getattr(pytest, "__version__", "?"), "pytest_file": getattr(pytest, "__file__", ""),
             "plugins": plugins, "root_first_on_path": bool(sys.path) and
             os.path.abspath(sys.path[0] or ".") == os.path.abspath(root)}
    record = Record(watch)
    extra = [item for name in plugins for item in ("-p", name)] + coverage_off(plugins)
    try:  # --maxfail=0 last: the grader's must-fail canary must not stop the run (-x, --maxfail)
        code = int(pytest.main(extra + args + ["--maxfail=0"], plugins=[record]))
    except BaseException as exc:  # noqa: BLE001 - whatever ended the run, the report says so
        facts["error"], code = repr(exc)[:500], 3
    facts.update(watch.report())
    facts["changed"] = changed(record.saved if record.saved is not None else [], mine) + watch.changed()
    for stream in (sys.stdout, sys.stderr):  # pytest's own summary first, then the report
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    out.write(f"\n{nonce} {json.dumps({'outcomes': record.outcomes, **facts})}\n")
    out.flush()
    return code


if __name__ == "__main__":
    _EXIT(main())
