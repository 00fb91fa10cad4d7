"""Per-test outcomes from a test runner's output (``unittest -v`` and ``pytest -rA``).

A test that does not appear in the log did not pass: the caller treats missing as failed.
"""
from __future__ import annotations

import re

PASSED, FAILED, ERROR, SKIPPED = "PASSED", "FAILED", "ERROR", "SKIPPED"

_UNITTEST_HEAD = re.compile(r"^(\w+) \(([\w.]+)\)")
_UNITTEST_END = re.compile(r"\.\.\. (ok|FAIL|ERROR|skipped.*|expected failure|unexpected success)$")
_PYTEST = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+?|\S+\.py)(?: - .*)?$")
_UNITTEST_STATUS = {"ok": PASSED, "FAIL": FAILED, "ERROR": ERROR, "expected failure": PASSED,
                    "unexpected success": FAILED}
_PYTEST_STATUS = {"XFAIL": PASSED, "XPASS": FAILED}


def _unittest_name(method: str, dotted: str) -> str:
    # Python >= 3.11 prints "(module.Class.method)"; older versions "(module.Class)".
    return dotted if dotted.endswith("." + method) else f"{dotted}.{method}"


def parse(log: str) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    current = None
    for line in log.splitlines():
        line = line.rstrip()
        found = _PYTEST.match(line)
        if found:
            status, name = found.groups()
            outcomes[name] = _PYTEST_STATUS.get(status, status)
            continue
        head = _UNITTEST_HEAD.match(line)
        if head:
            current = _unittest_name(*head.groups())
        end = _UNITTEST_END.search(line)
        if end and current:
            word = end.group(1)
            outcomes[current] = SKIPPED if word.startswith("skipped") else _UNITTEST_STATUS[word]
            current = None
    return outcomes


def report(outcomes: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str]) -> dict:
    """SWE-bench style report: each listed test's outcome, and whether the instance is resolved."""
    def status(name: str) -> str:
        return outcomes.get(name, "MISSING")

    f2p = {name: status(name) for name in fail_to_pass}
    p2p = {name: status(name) for name in pass_to_pass}
    resolved = all(v == PASSED for v in f2p.values()) and all(v == PASSED for v in p2p.values())
    passed = sum(v == PASSED for v in [*f2p.values(), *p2p.values()])
    total = len(f2p) + len(p2p)
    return {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "resolved": resolved,
            "tests_passed": passed, "tests_total": total}
