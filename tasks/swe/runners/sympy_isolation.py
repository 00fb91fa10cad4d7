"""SymPy's ``bin/test`` replaced by the grader's own runner, :mod:`tasks.swe.runners.sympy_runner`.

``bin/test`` only parses its options and calls ``sympy.test``, which is
``sympy/testing/runtests.py``: all of it package code a patch can reach in process. :func:`rewrite`
turns each ``bin/test`` / ``./bin/test`` / ``python bin/test`` of a test command into
``runner(python, index)`` followed by the same arguments, which the grader's runner reads as
``bin/test`` does. The runner runs the named test files' ``test_*`` functions itself.
"""
from __future__ import annotations

from typing import Callable

from tasks.swe.runners import command_rewrite
from tasks.swe.runners.base import RUNNERS_DIR, ScriptRunner

SCRIPT = "bin/test"
_BIN_TEST = command_rewrite.script_runs(SCRIPT)


def rewrite(command: str, runner: Callable[[str, int], str]) -> tuple[str, int]:
    """(``command`` with each run of ``bin/test`` replaced by ``runner(python, index)``, how many).
    ``bin/test``'s own ``#!/usr/bin/env python`` names ``python``."""
    return command_rewrite.rewrite(command, _BIN_TEST, runner, "python")


class SympyRunner(ScriptRunner):
    """SymPy's ``bin/test`` replaced by :mod:`tasks.swe.runners.sympy_runner`."""

    kind = "sympy-isolated"
    name = "sympy"
    script = RUNNERS_DIR / "sympy_runner.py"
    errors_once = True
    note = ("outcomes parsed from the test log, cross-checked with the grader's own SymPy runner's record (it "
            "runs the test functions itself, from sources read before the package loads; SymPy's runner is the "
            "package's code); the code under test still runs in the test process")
    rewrite = staticmethod(rewrite)  # the module's
