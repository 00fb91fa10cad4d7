"""The test runners of the SWE grader, one per repository family: each swaps the family's own runner for the grader's.

A family is a :class:`~tasks.swe.runners.base.TestRunner` in its own module, registered here by
the ``kind`` its runs report in ``eval.integrity.runner``. The grader tries them in this order
and isolates the first family the test command runs: Django's ``tests/runtests.py`` and SymPy's
``bin/test`` before pytest (a Django or SymPy command may name pytest too, but its runs are the
family's). A command that runs none of them is read from its log alone.
"""
from __future__ import annotations

import functools

from prorl_celery.errors import UnknownPlugin
from prorl_celery.plugins import Registry
from tasks.swe.runners.base import TestRunner, check_runner

RUNNERS = Registry("test runner", {
    "django-guarded": "tasks.swe.runners.django_isolation:DjangoRunner",
    "sympy-isolated": "tasks.swe.runners.sympy_isolation:SympyRunner",
    "pytest-isolated": "tasks.swe.runners.pytest_isolation:PytestRunner",
}, check=check_runner, paths=False)


@functools.cache
def get_runner(kind: str) -> TestRunner:
    """The runner of ``kind`` (checked by :func:`~tasks.swe.runners.base.check_runner`); an
    unknown kind lists the known ones."""
    runner = RUNNERS.load(kind)()
    if runner.kind != RUNNERS.canonical(kind):
        raise UnknownPlugin(f"test runner {kind!r} says its kind is {runner.kind!r}")
    return runner


def in_order() -> list[TestRunner]:
    """Every registered runner, in the order the grader tries them."""
    return [get_runner(kind) for kind in RUNNERS.entries]


def known(kind: str) -> TestRunner | None:
    """The runner of ``kind`` if one is registered (None for ``log``, ``unittest-guard``)."""
    return get_runner(kind) if kind in RUNNERS.entries else None
