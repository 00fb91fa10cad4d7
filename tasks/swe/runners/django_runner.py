"""Runs Django's ``tests/runtests.py`` with a record of outcomes the code under test did not write
(standard library only; the SWE grader copies it into the sandbox).

    python3 django_runner.py NONCE_FILE ROOT tests/runtests.py ARGS...   (in the repository's root)

Django's runner (``DiscoverRunner``, its result classes, ``SimpleTestCase``) is part of the
package a patch may change, so nothing it prints can be believed. Before any of the repository
is imported this script reads (and deletes) the nonce file, takes its own handle on stdout,
snapshots the unittest machinery and wraps ``unittest.TestCase.run`` (standard library code that
every Django test goes through) so that each call records what the test reported to its result.
Then ``runtests.py`` runs in this process as ``python3 tests/runtests.py`` would run it (its
directory first on ``sys.path``). At the end one line ``<nonce> <json>`` gives the recorded
outcomes under the names a log gives them (``m (mod.Class)``, ``str(test)``, the docstring's
first line) and ``changed``: the unittest attributes (the wrapper included) the package replaced,
after which the record cannot be believed; then the process ends with the ``os._exit`` saved
before the package loaded (no ``atexit`` hook of the package runs after it).

The test modules the labels name (with the other files of their directories; a package whole,
all of ``tests/`` without labels) are read before anything is imported, and the watch of
:mod:`tasks.swe.runners.run_watch` (copied beside this script) checks each test's method against the
code compiled from them as ``TestCase.run`` starts it, and notes a profile or trace hook or a
replaced ``__code__`` (the report's ``hooks`` and ``replaced``; this file's functions replaced are
``changed`` too).

The grader cross-checks the log's passes with this record. The code under test still runs in this
process: it can find this module's objects in memory; canaries catch a blanket forgery.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import unittest
import unittest.case
import unittest.result
import unittest.suite

_EXIT = os._exit  # the package may replace os._exit (to let its atexit hooks run)
_MACHINERY = (unittest.case.TestCase, unittest.suite.BaseTestSuite, unittest.suite.TestSuite,
              unittest.result.TestResult, unittest.case._Outcome, unittest.case, unittest.suite,
              unittest.result, unittest)


class Record:
    """Outcomes by test, as ``unittest.TestCase.run`` reported them to the result it was given."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}

    def set(self, test, status: str) -> None:
        for name in _names(test):  # the last report wins, as in the log parser's reading
            self.outcomes[name] = status


def _names(test) -> list[str]:
    """The names a log may give ``test``: ``m (mod.Class)``, ``str(test)`` (``m (mod.Class.m)``
    from Python 3.11), and the first line of its docstring (Django's verbose runner prints it)."""
    cls = type(test)
    names = [f"{test._testMethodName} ({cls.__module__}.{cls.__qualname__})", str(test)]
    try:
        doc = test.shortDescription()
    except Exception:  # noqa: BLE001 - a test's description is the test's own code
        doc = None
    return names + ([doc.strip()] if doc and doc.strip() else [])


class _Watch:
    """Stands in for the result ``TestCase.run`` reports to: records each report, passes it on."""

    def __init__(self, result, test, record: Record) -> None:
        self._result, self._test, self._record = result, test, record

    def __getattr__(self, name: str):
        return getattr(self._result, name)

    def _note(self, status: str, method: str, *args):
        self._record.set(self._test, status)
        return getattr(self._result, method)(*args)

    def addSuccess(self, test):
        return self._note("PASSED", "addSuccess", test)

    def addFailure(self, test, err):
        return self._note("FAILED", "addFailure", test, err)

    def addError(self, test, err):
        return self._note("ERROR", "addError", test, err)

    def addSkip(self, test, reason):
        return self._note("SKIPPED", "addSkip", test, reason)

    def addExpectedFailure(self, test, err):
        return self._note("PASSED", "addExpectedFailure", test, err)

    def addUnexpectedSuccess(self, test):
        return self._note("FAILED", "addUnexpectedSuccess", test)

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self._record.set(self._test, "FAILED")
        return self._result.addSubTest(test, subtest, err)


def watch(record: Record, code_watch=None):
    """``unittest.TestCase.run``, recording into ``record`` (each test's method checked by
    ``code_watch`` first)."""
    original = unittest.case.TestCase.run

    def run(self, result=None):
        if result is None:  # unittest makes its own result: nothing of the package's reads it
            return original(self, result)
        if code_watch is not None:
            code_watch.check_case(self)
        return original(self, _Watch(result, self, record))
    return run


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


def labels_read(watch_mod, code_watch, tests_dir: str, args: list[str]) -> None:
    """The test modules ``runtests.py``'s labels name, read (all of ``tests/`` without labels)."""
    labels = [a for a in args if not a.startswith("-") and not a.isdigit()]
    paths = watch_mod.dotted_paths(tests_dir, labels)
    code_watch.read(paths if paths else [tests_dir])


def changed(saved: list[tuple[object, dict]], wrapper) -> list[str]:
    """The snapshotted attributes that differ now (a class's new attributes too)."""
    names = []
    for owner, attrs in saved:
        current = vars(owner)
        added = [n for n in current if n not in attrs] if isinstance(owner, type) else []
        names += [f"{getattr(owner, '__name__', owner)}.{n}" for n in added]
        names += [f"{getattr(owner, '__name__', owner)}.{n}" for n, v in attrs.items()
                  if current.get(n) is not v and n not in ("__dict__", "__weakref__")]
    if vars(unittest.case.TestCase).get("run") is not wrapper:
        names.append("TestCase.run (the grader's record)")
    return sorted(set(names))


def _take_nonce(nonce_file: str) -> str:
    """The nonce, read from its file, which is deleted (the package never sees it)."""
    with open(nonce_file) as fh:
        nonce = fh.read().strip()
    os.unlink(nonce_file)
    return nonce


def _as_script(path: str, args: list[str]) -> None:
    """``sys.path`` and ``sys.argv`` as ``python3 path args...`` has them (this file's directory
    off the path)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(path)] + [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.argv = [path, *args]


def _exit_status(value) -> int:
    """The status a ``SystemExit`` carrying ``value`` ends a process with (0, 1 or the int)."""
    return value if isinstance(value, int) else (0 if value is None else 1)


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):  # the runner's own summary first, then the report
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def main() -> int:
    nonce_file, root, script, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    nonce = _take_nonce(nonce_file)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    mine = {n: v for n, v in globals().items() if callable(v) and not n.startswith("__")}
    path = os.path.abspath(os.path.join(root, script))
    watch_mod = load_watch()
    code_watch = watch_mod.Watch(root)
    labels_read(watch_mod, code_watch, os.path.dirname(path), args)  # before any of the repository runs
    code_watch.start()
    record = Record()
    wrapper = watch(record, code_watch)
    unittest.case.TestCase.run = wrapper
    saved = [(owner, dict(vars(owner))) for owner in _MACHINERY]
    _as_script(path, args)
    facts: dict = {}
    try:  # runtests.py runs here in main, at the stack depth it always had
        runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException as exc:  # noqa: BLE001 - whatever ended the run, the report says so
        facts["error"], code = repr(exc)[:500], 3
    _flush_streams()
    mine_changed = [f"runner.{n}" for n, v in mine.items() if globals().get(n) is not v] + code_watch.changed()
    report = {"outcomes": record.outcomes, "changed": changed(saved, wrapper) + mine_changed, "exit": code,
              **facts, **code_watch.report()}
    out.write(f"\n{nonce} {json.dumps(report)}\n")
    out.flush()
    return code


if __name__ == "__main__":
    _EXIT(main())
