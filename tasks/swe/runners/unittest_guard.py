"""Runs unittest tests and reports outcomes the code under test did not write (standard library only).

    python3 unittest_guard.py NONCE_FILE [-v] NAME...   (in the repository's root)

The SWE grader runs this in place of ``python3 -m unittest``. Before any of the repository is
imported it reads (and deletes) the nonce file, takes its own handle on stdout, and snapshots
the unittest machinery (``TestCase``, ``TestSuite``, ``TestResult``, ``_Outcome`` and the
modules that hold them). Loading the tests imports the package; then every attribute of that
machinery the package changed is put back, and the tests run into a result class defined here.
The outcomes are printed as unittest's ``-v`` lines (for the log) and as one line
``<nonce> <json>``, the only one the grader believes.

This defeats a package that, on import, overrides ``TestCase.run`` (or ``addSuccess``,
``assertEqual`` ...) so that failures read as passes. The modules the names point to (with the
other files of their directories) are read before anything is imported, and the watch of
:mod:`tasks.swe.runners.run_watch` (copied beside this script) checks each test's method against the
code compiled from them just before it runs, and notes a profile or trace hook or a replaced
``__code__``: the report's ``hooks`` and ``replaced``, with ``changed`` (this file's functions). It cannot defeat code that keeps running
in this process and patches again later (a test calls the package, which re-patches, walks the
stack, or finds this module's objects with ``gc``): the code under test runs in the test process,
as it must for its tests to call it. The SWE grader's canaries (a must-fail test planted in the
same modules) catch such a forgery when it turns failures into passes across the board.
"""
from __future__ import annotations

import json
import os
import sys
import unittest
import unittest.case
import unittest.loader
import unittest.result
import unittest.suite

_EXIT = os._exit  # the package may replace os._exit (to let its atexit hooks run)

_MACHINERY = (unittest.case.TestCase, unittest.suite.BaseTestSuite, unittest.suite.TestSuite,
              unittest.result.TestResult, unittest.case._Outcome, unittest.case, unittest.suite,
              unittest.result, unittest.loader.TestLoader, unittest)


def snapshot() -> list[tuple[object, dict]]:
    return [(owner, dict(vars(owner))) for owner in _MACHINERY]


def restore(saved: list[tuple[object, dict]]) -> list[str]:
    """Put every snapshotted attribute back; returns the names that had been changed."""
    changed = []
    for owner, attrs in saved:
        current = vars(owner)
        added = [n for n in current if n not in attrs] if isinstance(owner, type) else []
        for name in added:  # on a module, a submodule imported later is not an attack
            changed.append(f"{getattr(owner, '__name__', owner)}.{name}")
            delattr(owner, name)
        for name, value in attrs.items():
            if current.get(name) is not value and name not in ("__dict__", "__weakref__"):
                changed.append(f"{getattr(owner, '__name__', owner)}.{name}")
                setattr(owner, name, value)
    return changed


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


class Record(unittest.result.TestResult):
    """Each test's outcome, as this process saw it (each test's method checked by the watch first)."""

    def __init__(self, out, watch=None) -> None:
        super().__init__()
        self.out = out
        self.watch = watch
        self.outcomes: dict[str, str] = {}

    def _set(self, test, status: str, word: str) -> None:
        if self.outcomes.get(test.id()) in (None, "RUNNING", "PASSED"):
            self.outcomes[test.id()] = status
        self.out.write(f"{test._testMethodName} ({test.id()}) ... {word}\n")

    def startTest(self, test) -> None:
        self.testsRun += 1
        self.outcomes[test.id()] = "RUNNING"
        if self.watch is not None:
            self.watch.check_case(test)

    def stopTest(self, test) -> None:
        pass

    def addSuccess(self, test) -> None:
        if self.outcomes.get(test.id()) == "RUNNING":
            self._set(test, "PASSED", "ok")

    def addFailure(self, test, err) -> None:
        self._set(test, "FAILED", "FAIL")

    def addError(self, test, err) -> None:
        self._set(test, "ERROR", "ERROR")

    def addSubTest(self, test, subtest, err) -> None:
        if err is not None:
            self._set(test, "FAILED", "FAIL")

    def addSkip(self, test, reason) -> None:
        self._set(test, "SKIPPED", f"skipped {reason!r}")

    def addExpectedFailure(self, test, err) -> None:
        self._set(test, "PASSED", "expected failure")

    def addUnexpectedSuccess(self, test) -> None:
        self._set(test, "FAILED", "unexpected success")


def _take_nonce(nonce_file: str) -> str:
    """The nonce, read from its file, which is deleted (the package never sees it)."""
    with open(nonce_file) as fh:
        nonce = fh.read().strip()
    os.unlink(nonce_file)
    return nonce


def _mine_changed(mine: dict, methods: dict) -> list[str]:
    """This file's functions and :class:`Record`'s methods that differ now from ``mine`` and ``methods``."""
    names = [f"guard.{n}" for n, v in mine.items() if globals().get(n) is not v]
    return names + [f"Record.{n}" for n, v in methods.items() if vars(Record).get(n) is not v]


def main() -> int:
    nonce_file, names = sys.argv[1], [a for a in sys.argv[2:] if not a.startswith("-")]
    nonce = _take_nonce(nonce_file)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    mine = {n: v for n, v in globals().items() if callable(v) and not n.startswith("__")}
    methods = dict(vars(Record))
    watch_mod = load_watch()
    watch = watch_mod.Watch(os.getcwd())
    watch.read(watch_mod.dotted_paths(os.getcwd(), names))  # before any of the repository is imported
    watch.start()
    saved = snapshot()
    sys.path.insert(0, os.getcwd())
    try:
        suite = unittest.defaultTestLoader.loadTestsFromNames(names)
    except BaseException as exc:  # noqa: BLE001 - an import error is the tests' outcome
        out.write(f"\n{nonce} {json.dumps({'outcomes': {}, 'error': repr(exc)[:500], **watch.report()})}\n")
        return 1
    changed = restore(saved)
    record = Record(out, watch)
    suite.run(record)
    changed += restore(saved)
    outcomes = {k: ("FAILED" if v == "RUNNING" else v) for k, v in record.outcomes.items()}
    mine_changed = _mine_changed(mine, methods)
    report = {"outcomes": outcomes, "restored": sorted(set(changed)), **watch.report(),
              "changed": mine_changed + watch.changed()}
    out.write(f"\n{nonce} {json.dumps(report)}\n")
    return 0 if all(v in ("PASSED", "SKIPPED") for v in outcomes.values()) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    _EXIT(code)
