"""Django's ``tests/runtests.py`` run under :mod:`tasks.verify.django_runner`, whose record of
outcomes the grader cross-checks with the log (Django's runner is the package's own code).

:func:`rewrite` turns each ``./tests/runtests.py`` / ``python tests/runtests.py`` of a test command
into ``runner(python, index)`` followed by the script and its arguments; the script itself is the
base commit's (``tests/`` is reset to the base before the run).
"""
from __future__ import annotations

import re
from typing import Callable

SCRIPT = "tests/runtests.py"
_RUNTESTS = re.compile(r"(^|[;&|(){}\n]|\bthen|\bdo|\belse)(\s*(?:[A-Za-z_]\w*=\S*\s+)*)"
                       r"(?:(python(?:3(?:\.\d+)?)?)\s+)?(?:\./)?tests/runtests\.py(?=\s|$|;)")


def rewrite(command: str, runner: Callable[[str, int], str]) -> tuple[str, int]:
    """(``command`` with each run of Django's runner replaced by ``runner(python, index)`` and the
    script's path, how many). ``runtests.py``'s own ``#!/usr/bin/env python`` names ``python``."""
    count = 0

    def swap(found: re.Match) -> str:
        nonlocal count
        count += 1
        return f"{found.group(1)}{found.group(2)}{runner(found.group(3) or 'python', count - 1)} {SCRIPT}"

    return _RUNTESTS.sub(swap, command), count
