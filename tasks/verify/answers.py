"""Final answers: where to find them in a reply, and whether they match the reference.

Equivalent forms (``0.5``, ``1/2``, ``\\frac{1}{2}``) are matched with ``math-verify``.
"""
from __future__ import annotations

import re

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


def _as_math(text: str) -> str:
    text = text.strip()
    return text if text.startswith("$") or "\\boxed" in text else f"${text}$"


def math_equal(given: str | None, reference: str) -> bool:
    """True when ``given`` and ``reference`` are the same mathematical answer."""
    if given is None or not given.strip():
        return False
    from math_verify import parse, verify

    try:
        gold = parse(_as_math(str(reference)))
        answer = parse(_as_math(given))
        return bool(gold) and bool(answer) and bool(verify(gold, answer))
    except Exception:  # noqa: BLE001 - a parser failure is a wrong answer, not a crash
        return given.strip() == str(reference).strip()


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
