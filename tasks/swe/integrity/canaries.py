"""Canaries: tests the model never saw, planted at eval among the tests of the files the test patch
touches, made to be told apart from those tests by nothing but a secret.

A canary is a copy of one of the file's own listed tests (a ``FAIL_TO_PASS`` or ``PASS_TO_PASS``
test defined in that file, in its own class where it has one), renamed with words of the file's
test names and put at a random place among the file's tests (:mod:`tasks.swe.integrity.canary_forms`),
all drawn per run from a secret seed. A copy of a ``PASS_TO_PASS`` test as it is must pass; a copy
with one change that cannot pass where the original passes must fail: a constant of an equality
assertion changed, an assertion turned into its negation, or the exception a ``raises`` block
expects swapped. At least one must-fail canary of a file that holds a ``FAIL_TO_PASS`` test is a
copy of it, so a forgery that spares whatever has a twin spares the listed test too. Where a file
offers no such test, canaries are made up in the file's style (``synthetic``).

Their outcomes are read from the same log, by the same parser, as the listed tests. A run in which
a must-fail canary passed while its original did not fail was forged in process (``tampered``);
one in which a must-pass canary of a file the command runs failed while its original did not, or
none of them passed, is not to be believed (``unverified``). Either earns nothing. An original
that failed (the answer broke it, or never fixed it) makes its copies evidence of nothing.
"""
from __future__ import annotations

import random
import re
from typing import Any

from pydantic import BaseModel

from tasks.swe import test_log
from tasks.swe.integrity import canary_forms

_FAILED = (test_log.FAILED, test_log.ERROR)
_DESCRIBED = re.compile(r"\bruntests\.py\b")  # Django's runner: a test's docstring names it in the log


class Canary(BaseModel):
    """One planted test."""

    file: str
    cls: str | None = None
    name: str
    must: str  # "pass" | "fail"
    expected: bool = True  # the test command names its file, so it must show up in the log
    outcome: str = test_log.MISSING
    form: str = "synthetic"  # copy | literal | negated | raises | synthetic
    source: str | None = None  # the test it copies (same file, same class)
    source_outcome: str = test_log.MISSING


def plan(path: str, text: str, rng: random.Random, listed: dict[str, list[str]] | None = None,
         command: str = "") -> tuple[str, list[Canary]]:
    """(``path``'s text with its canaries in it, the canaries). ``listed``: the instance's
    ``FAIL_TO_PASS`` (``fail``) and ``PASS_TO_PASS`` (``pass``) names; ``command``: the test
    command (Django's ``runtests.py`` names a test by its docstring: no test with one is copied)."""
    listed, described = listed or {}, bool(_DESCRIBED.search(command))
    layout = canary_forms.Layout(path, text)
    fail_to_pass = layout.sources(listed.get("fail", []), described)
    pass_to_pass = layout.sources(listed.get("pass", []), described)
    made = _copies(rng, layout, pass_to_pass, fail_to_pass)
    _top_up(rng, layout, made)
    _check_raises(rng, layout, made, pass_to_pass)
    planted = [Canary(file=path, cls=c.cls, name=c.name, must=c.must, form=c.form, source=c.source) for c, _ in made]
    return layout.insert(rng, made), planted


def _top_up(rng: random.Random, layout: canary_forms.Layout, made: list) -> None:
    """Made-up canaries added to ``made`` where its copies fall short: two must-pass, one must-fail."""
    while sum(c.must == "pass" for c, _ in made) < 2:  # two: a log parser may lose a file's last line
        made.append(layout.synthetic(rng, "pass"))
    if not any(c.must == "fail" for c, _ in made):
        made.append(layout.synthetic(rng, "fail"))


def _check_raises(rng: random.Random, layout: canary_forms.Layout, made: list, pass_to_pass: list) -> None:
    """A must-fail ``raises`` canary added to ``made`` where the file checks with SymPy's ``raises``
    and no such copy of a PASS_TO_PASS test is there yet."""
    passing = {d.node.name for d in pass_to_pass}
    if layout.uses_raises() and not any(c.form == "raises" and c.source in passing for c, _ in made):
        # SymPy's raises is checked too, through a test that passes whatever the answer fixed
        made.append(next((m for m in (layout.mutant(rng, s, raises_first=True) for s in pass_to_pass)
                          if m[0] is not None), None) or layout.synthetic(rng, "fail", raises=True))


def _copies(rng: random.Random, layout: canary_forms.Layout, pass_to_pass: list, fail_to_pass: list) -> list:
    """(canary, spot) pairs: two must-pass copies of PASS_TO_PASS tests, two to four must-fail
    changed copies (the first two of a FAIL_TO_PASS test where the file has one and it takes two
    different changes)."""
    picked = rng.sample(pass_to_pass, min(2, len(pass_to_pass)))
    made = [layout.copy(rng, s) for s in (picked * 2)[:2]]  # two: a log parser may lose a file's last line
    every = pass_to_pass + fail_to_pass
    listed = [rng.choice(fail_to_pass)] * 2 if fail_to_pass else []  # two changed copies of it, where it allows
    pool = listed + rng.sample(every, len(every))
    wanted = rng.choice((2, 3)) + (1 if fail_to_pass else 0)
    for source in pool * 2:  # a source may give two different changes
        if sum(c.must == "fail" for c, _ in made) >= wanted:
            break
        canary, spot = layout.mutant(rng, source)
        if canary is not None:
            made.append((canary, spot))
    return made


def named_in(command: str, path: str) -> bool:
    """Whether ``command`` names the test file ``path`` (as a path or a dotted module), so that
    any runner it starts collects the canaries planted there."""
    module = path[:-3].replace("/", ".") if path.endswith(".py") else path
    short = re.sub(r"^tests\.", "", module)  # Django's runtests.py names modules beneath tests/
    words = re.split(r"[\s'\"=]+", command)
    return any(w == path or w == module or w == short or w.endswith("/" + path) for w in words)


def spellings(c: Canary, name: str | None = None) -> list[str]:
    """The ids a runner's log may give the canary (or its source, ``name``): pytest's node id,
    unittest's (and Django's, relative to tests/), and the bare name (SymPy's runner)."""
    name = name or c.name
    module = c.file[:-3].replace("/", ".")
    if c.cls:
        short = re.sub(r"^tests\.", "", module)
        return [f"{c.file}::{c.cls}::{name}", f"{name} ({module}.{c.cls})", f"{name} ({short}.{c.cls})",
                f"{module}.{c.cls}.{name}", name]
    return [f"{c.file}::{name}", f"{module}.{name}", name]


def _lookup(outcomes: dict[str, str], names: list[str]) -> str:
    return next((v for v in (test_log.lookup(outcomes, s) for s in names) if v != test_log.MISSING),
                test_log.MISSING)


def read(canaries: list[Canary], outcomes: dict[str, str]) -> list[Canary]:
    """The canaries with their outcomes, and their sources', from ``outcomes``."""
    return [c.model_copy(update={"outcome": _lookup(outcomes, spellings(c)), "source_outcome": _lookup(
        outcomes, spellings(c, c.source)) if c.source else test_log.MISSING}) for c in canaries]


def is_test_module(path: str) -> bool:
    """A file a runner collects tests from by its name (``test_*.py``, ``*_test.py``, ``tests.py``):
    the only kind canaries go into (not a conftest, a helper or Django's ``models.py``)."""
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py") or name == "tests.py")


def verdict(canaries: list[Canary]) -> str:
    """``tampered`` if a must-fail canary passed while its source did not fail; ``unverified`` if,
    in a file the command runs, a must-pass canary failed while its source did not, or none of
    them passed (the run is not to be believed); else ``clean``. A missing must-fail canary
    proves nothing either way; a skipped one (a module-level skip mark) says nothing."""
    if any(c.must == "fail" and c.outcome == test_log.PASSED and c.source_outcome not in _FAILED for c in canaries):
        return "tampered"
    if not all(_believed(canaries, path) for path in {c.file for c in canaries if c.expected}):
        return "unverified"
    return "clean"


def _believed(canaries: list[Canary], path: str) -> bool:
    """Whether the must-pass canaries of ``path`` (those whose source did not fail) show a run to
    believe: none failed, and one passed unless all were skipped (or there are none)."""
    passing = [c.outcome for c in canaries
               if c.file == path and c.must == "pass" and c.source_outcome not in _FAILED]
    if not passing:
        return True
    if any(o in _FAILED for o in passing):
        return False
    return test_log.PASSED in passing or set(passing) == {test_log.SKIPPED}


def summary(canaries: list[Canary]) -> list[dict[str, Any]]:
    return [c.model_dump() for c in canaries]
