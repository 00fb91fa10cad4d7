"""Final answers: where to find them in a reply, and whether they match the reference.

Equivalent forms (``0.5``, ``1/2``, ``\\frac{1}{2}``) are matched with ``math-verify``, in the
verifier pool's worker processes (:mod:`tasks.verify.math_pool`).
"""
from __future__ import annotations

import re

from tasks.verify import math_pool
from tasks.verify.math_pool import Check, Verdict

_ALONE = re.compile(r"^\s*\(?([A-Ja-j])\)?[.)]?\s*$")
_STATED = re.compile(r"answer\s*(?:is|:)\s*\(?([A-J])\b", re.I)
_PAREN = re.compile(r"\(([A-J])\)")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, out = 1, []
    while i < len(text):
        ch = text[i]
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return "".join(out).strip()
        out.append(ch)
        i += 1
    return None


def check_math(given: str | None, reference: str) -> Check | None:
    """How ``given`` compares with ``reference`` (None: no answer given). Every check runs in
    this process's verifier pool (:mod:`tasks.verify.math_pool`): a process of its own, capped
    in memory and CPU, with its own deadline, so a hostile answer costs only its own score."""
    if given is None or not given.strip():
        return None
    return math_pool.shared().check(given, str(reference))


def math_equal(given: str | None, reference: str) -> bool:
    """True when ``given`` and ``reference`` are the same mathematical answer."""
    found = check_math(given, reference)
    return found is not None and found.verdict is Verdict.EQUAL


def choice_letter(text: str | None, letters: str = "ABCDEFGHIJ") -> str | None:
    """The multiple-choice letter an answer names (``"B"``, ``"(b)"``, ``"The answer is C"``)."""
    if not text:
        return None
    text = last_boxed(text) or text
    for pattern in (_ALONE, _STATED, _PAREN):
        found = [m.group(1).upper() for m in pattern.finditer(text) if m.group(1).upper() in letters]
        if found:
            return found[-1]
    return None
