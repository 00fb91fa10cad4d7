"""Django's ``tests/runtests.py`` run under :mod:`tasks.swe.runners.django_runner`, whose record of
outcomes the grader cross-checks with the log (Django's runner is the package's own code).

:func:`rewrite` turns each ``./tests/runtests.py`` / ``python tests/runtests.py`` of a test command
into ``runner(python, index)`` followed by the script and its arguments; the script itself is the
base commit's (``tests/`` is reset to the base before the run).
"""
from __future__ import annotations

from typing import Callable

from tasks.swe.runners import command_rewrite
from tasks.swe.runners.base import RUNNERS_DIR, ScriptRunner

SCRIPT = "tests/runtests.py"
_RUNTESTS = command_rewrite.script_runs(SCRIPT)


def rewrite(command: str, runner: Callable[[str, int], str]) -> tuple[str, int]:
    """(``command`` with each run of Django's runner replaced by ``runner(python, index)`` and the
    script's path, how many). ``runtests.py``'s own ``#!/usr/bin/env python`` names ``python``."""
    return command_rewrite.rewrite(command, _RUNTESTS, runner, "python", f" {SCRIPT}")


class DjangoRunner(ScriptRunner):
    """Django's runner under :mod:`tasks.swe.runners.django_runner`'s recorder."""

    kind = "django-guarded"
    name = "django"
    script = RUNNERS_DIR / "django_runner.py"
    errors_once = True
    note = ("outcomes parsed from the test log, cross-checked with a record unittest's TestCase.run "
            "kept (Django's runner is the package's code); the code under test still runs in the test process")
    rewrite = staticmethod(rewrite)  # the module's
