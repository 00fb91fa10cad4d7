"""Per-test outcomes from a test runner's output (``unittest -v`` and ``pytest -rA``), the test
lists of an instance, and the SWE-bench style report.

pytest prints a parametrized id as it is, spaces and all (a newline in a parameter comes out as
the two characters ``\\n``): ``PASSED t.py::test_count[\\n    | **Anti-pattern**-1]``. The id
ends at the bracket that closes its first ``[``, before an optional `` - <message>``; an id whose
bracket is still open at the end of a line (ids printed unescaped) goes on to the next lines.

SWE-bench's own parsers keep only the first whitespace-separated word of such an id, so its data
lists ``t.py::test_count[\\n``. :func:`lookup` finds a listed test either way: exactly, by the
first word of the listed id (a log read by a SWE-bench parser), or, for a listed id cut at its
first space, the full ids whose first word it is, when they agree on the outcome.

A unittest id is found as ``m (mod.Class)`` (older Pythons, and SWE-bench's Django data), as
``m (mod.Class.m)`` (Python >= 3.11) or as ``mod.Class.m``, whichever the log has.

A test that does not appear in the log did not pass: the caller treats missing as failed.
"""
from __future__ import annotations

import json
import re
from typing import Any

from prorl_celery.errors import InvalidRequest

PASSED, FAILED, ERROR, SKIPPED, MISSING = "PASSED", "FAILED", "ERROR", "SKIPPED", "MISSING"

_UNITTEST_HEAD = re.compile(r"^(\w+) \(([\w.]+)\)")
_UNITTEST_END = re.compile(r"\.\.\. (ok|FAIL|ERROR|skipped.*|expected failure|unexpected success)$")
_PYTEST_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S.*)$")
_UNITTEST_STATUS = {"ok": PASSED, "FAIL": FAILED, "ERROR": ERROR, "expected failure": PASSED,
                    "unexpected success": FAILED}
_PYTEST_STATUS = {"XFAIL": PASSED, "XPASS": FAILED}
_MAX_ID_LINES = 20  # an id left open longer than this is not an id


def _unittest_name(method: str, dotted: str) -> str:
    # Python >= 3.11 prints "(module.Class.method)"; older versions "(module.Class)".
    return dotted if dotted.endswith("." + method) else f"{dotted}.{method}"


def _id_end(text: str) -> int | None:
    """Where the pytest node id at the start of ``text`` ends: -1 if it is no node id (the
    ``SKIPPED [1] t.py:9: reason`` summary), None while its parameter bracket is still open."""
    first = text.split(" ", 1)[0]
    bracket = first.find("[")
    head = first if bracket < 0 else first[:bracket]
    if "::" not in head and not head.endswith(".py"):
        return -1
    if bracket < 0:
        return len(first)
    depth = 0
    for i in range(bracket, len(text)):
        depth += {"[": 1, "]": -1}.get(text[i], 0)
        if depth == 0 and (i + 1 == len(text) or text.startswith(" - ", i + 1)):
            return i + 1
    return None


def _unbalanced_id(text: str) -> str:
    """An id whose brackets never balance: up to the last ``]`` before the end or `` - ``."""
    ends = [m.end() for m in re.finditer(r"\](?= - |$)", text)]
    return text[:ends[-1]] if ends else text.split(" ", 1)[0]


def _pytest_id(lines: list[str], at: int) -> tuple[str | None, int]:
    """(the node id that starts after the status word on line ``at``, lines it took)."""
    first = text = _PYTEST_LINE.match(lines[at]).group(2)
    for taken in range(1, _MAX_ID_LINES + 1):
        end = _id_end(text)
        if end is not None:
            return (text[:end] if end > 0 else None), taken
        if at + taken >= len(lines) or _PYTEST_LINE.match(lines[at + taken]):
            break
        text = f"{text}\n{lines[at + taken]}"
    return _unbalanced_id(first), 1


def parse(log: str) -> dict[str, str]:
    """Outcomes by test name; pytest names are node ids, unittest names ``module.Class.method``."""
    outcomes: dict[str, str] = {}
    lines = [line.rstrip() for line in log.splitlines()]
    current, i = None, 0
    while i < len(lines):
        line, taken = lines[i], 1
        found = _PYTEST_LINE.match(line)
        if found:
            name, taken = _pytest_id(lines, i)
            if name:
                outcomes[name] = _PYTEST_STATUS.get(found.group(1), found.group(1))
                i += taken
                continue
        head = _UNITTEST_HEAD.match(line)
        if head:
            current = _unittest_name(*head.groups())
        end = _UNITTEST_END.search(line)
        if end and current:
            word = end.group(1)
            outcomes[current] = SKIPPED if word.startswith("skipped") else _UNITTEST_STATUS[word]
            current = None
        i += 1
    return outcomes


def test_list(value: Any, field: str) -> list[str]:
    """An instance's ``FAIL_TO_PASS`` / ``PASS_TO_PASS``: a list of names, or that list as a JSON
    string (as the Hugging Face datasets store it). Anything else is
    :class:`~prorl_celery.errors.InvalidRequest` naming ``field``."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise InvalidRequest(f"{field} must be a list of test names or a JSON string of one; "
                                 "this string is not JSON", field=field) from None
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise InvalidRequest(f"{field} must be a list of test names (strings), or a JSON string "
                             "of one", field=field)
    return value


def _unittest_aliases(name: str) -> list[str]:
    """Other spellings of a unittest id: ``m (mod.Class)`` as Python >= 3.11 prints it
    (``m (mod.Class.m)``) and the other way round, and ``mod.Class.m``."""
    found = re.match(r"^(\w+) \(([\w.]+)\)$", name)
    if not found:
        return []
    method, dotted = found.groups()
    full = _unittest_name(method, dotted)
    short = full[: -len(method) - 1]
    return [f"{method} ({full})", f"{method} ({short})", full]


def lookup(outcomes: dict[str, str], name: str) -> str:
    """The outcome of the listed test ``name`` (see the module docstring), or ``MISSING``."""
    for spelling in [name, *_unittest_aliases(name)]:
        if spelling in outcomes:
            return outcomes[spelling]
    words = name.split()
    if len(words) > 1 and words[0] in outcomes:  # the log was read by a first-word parser
        return outcomes[words[0]]
    if name.count("[") > name.count("]"):  # the list was written by a first-word parser
        found = {outcomes[key] for key in outcomes if key.split(maxsplit=1)[0] == name}
        if len({v == PASSED for v in found}) == 1:
            return PASSED if PASSED in found else sorted(found)[0]
    return MISSING


def report(outcomes: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str]) -> dict:
    """SWE-bench style report: each listed test's outcome, and whether the instance is resolved."""
    f2p = {name: lookup(outcomes, name) for name in fail_to_pass}
    p2p = {name: lookup(outcomes, name) for name in pass_to_pass}
    resolved = all(v == PASSED for v in f2p.values()) and all(v == PASSED for v in p2p.values())
    passed = sum(v == PASSED for v in [*f2p.values(), *p2p.values()])
    total = len(f2p) + len(p2p)
    return {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "resolved": resolved,
            "tests_passed": passed, "tests_total": total}
