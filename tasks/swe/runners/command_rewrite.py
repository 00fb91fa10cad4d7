"""Each run of a test runner in a shell command, swapped for the grader's own (shared by the
pytest, Django and SymPy isolations).

A run is found where a command may start (the line's start, after ``;``, ``&``, ``|``, a
bracket, ``then``/``do``/``else``), after any ``NAME=value`` assignments, optionally behind a
``python``/``python3``/``python3.X`` that starts it; the rest of the command is left alone.
"""
from __future__ import annotations

import re
from typing import Callable

LEAD = r"(^|[;&|(){}\n]|\bthen|\bdo|\belse)(\s*(?:[A-Za-z_]\w*=\S*\s+)*)"
PYTHON = r"python(?:3(?:\.\d+)?)?"
END = r"(?=\s|$|;)"


def script_runs(script: str) -> re.Pattern:
    """Runs of the repository script ``script`` (``script``, ``./script``, ``python script``);
    group 3 is the python that starts it, if one does."""
    return re.compile(LEAD + rf"(?:({PYTHON})\s+)?(?:\./)?{re.escape(script)}{END}")


def rewrite(command: str, runs: re.Pattern, runner: Callable[[str, int], str], python: str,
            after: str = "") -> tuple[str, int]:
    """(``command`` with each match of ``runs`` replaced by ``runner(its python or python, index)``
    followed by ``after``, how many)."""
    count = 0

    def swap(found: re.Match) -> str:
        nonlocal count
        count += 1
        return f"{found.group(1)}{found.group(2)}{runner(found.group(3) or python, count - 1)}{after}"

    return runs.sub(swap, command), count
