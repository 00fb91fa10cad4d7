"""SymPy's ``bin/test`` replaced by the grader's runner: the command rewrite, and the runner script
run for real on a small tree laid out as SymPy's (a ``sympy`` package and its ``tests/`` files), in
a subprocess as the grader starts it. The real row is tests/security/test_reward_forgery_sympy.py."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.swe import specs as swe_specs
from tasks.swe.integrity import canaries
from tasks.swe.runners import sympy_isolation

SYMPY_CMD = f"{swe_specs.SYMPY} sympy/core/tests/test_calc.py"
HELPERS = '''
class XFail(Exception):
    pass


class Failed(Exception):
    pass


def XFAIL(func):
    def wrapper():
        try:
            func()
        except Exception:
            raise XFail(func.__name__)
        raise Failed("XPASS")
    wrapper.__name__ = func.__name__
    wrapper.__wrapped__ = func
    return wrapper


def slow(func):
    func._slow = True
    return func


def raises(kind, code):
    try:
        code()
    except kind:
        return
    raise Failed("DID NOT RAISE")
'''
TESTS = '''from sympy.testing.pytest import XFAIL, raises, slow
from sympy.core.calc import double


def test_double():
    assert double(2) == 4


def test_double_wrong():
    assert double(2) == 5


def test_double_errs():
    double(None)


@XFAIL
def test_double_known_bad():
    assert double(1) == 3


@slow
def test_double_slow():
    assert double(3) == 6


def test_double_raises():
    raises(TypeError, lambda: double(None))
'''


def _runner(python: str, index: int) -> str:
    return f"{python} /home/.prorl-sympy-runner.py /home/.prorl-sympy-nonce-{index} /home/repo"


@pytest.mark.unit
def test_each_run_of_bin_test_is_rewritten_and_nothing_else():
    command, count = sympy_isolation.rewrite(SYMPY_CMD, _runner)
    assert count == 1
    assert command == ("PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' python /home/.prorl-sympy-runner.py "
                       "/home/.prorl-sympy-nonce-0 /home/repo -C --verbose sympy/core/tests/test_calc.py")
    twice, count = sympy_isolation.rewrite("python3 bin/test a && ./bin/test b", _runner)
    assert count == 2 and twice.startswith("python3 /home/.prorl-sympy-runner.py") and "nonce-1 /home/repo b" in twice
    assert sympy_isolation.rewrite("echo bin/test; cat bin/test.py; bin/testing x", _runner)[1] == 0


def _tree(root: Path, init: str = "") -> Path:
    for path, text in {"sympy/__init__.py": init, "sympy/core/__init__.py": "",
                       "sympy/core/calc.py": "def double(x):\n    return 2 * x\n",
                       "sympy/core/cache.py": "def clear_cache():\n    pass\n", "sympy/testing/__init__.py": "",
                       "sympy/testing/pytest.py": HELPERS, "sympy/core/tests/__init__.py": "",
                       "sympy/core/tests/test_calc.py": TESTS, "sympy/core/tests/test_other.py": "def test_other():\n    pass\n",
                       }.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def _run(root: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    nonce = "n" + "0" * 31
    (root.parent / "nonce").write_text(nonce)
    script = sympy_isolation.SympyRunner.script
    done = subprocess.run([sys.executable, str(script), str(root.parent / "nonce"), str(root), *args],
                          cwd=root, capture_output=True, text=True, timeout=120)
    line = next(x for x in done.stdout.splitlines() if x.startswith(nonce + " "))
    return done, json.loads(line[len(nonce) + 1:])


def test_the_runner_judges_each_test_as_sympys_runner_and_prints_its_verbose_lines(tmp_path):
    root = _tree(tmp_path / "repo")
    done, report = _run(root, "-C", "--verbose", "sympy/core/tests/test_calc.py")
    outcomes = swe_specs.parse(swe_specs.spec_for({"repo": "sympy/sympy", "test_patch": ""}), done.stdout)
    assert {k: v for k, v in outcomes.items() if "::" not in k and ".py:" not in k} == {
        "test_double": "PASSED", "test_double_wrong": "FAILED", "test_double_errs": "ERROR",
        "test_double_raises": "PASSED"}, done.stdout
    assert {k: v for k, v in report["outcomes"].items() if "::" not in k} == {
        "test_double": "PASSED", "test_double_wrong": "FAILED", "test_double_errs": "ERROR",
        "test_double_known_bad": "FAILED", "test_double_slow": "SKIPPED", "test_double_raises": "PASSED"}
    assert "test_double_known_bad f" in done.stdout and "test_double_slow s" in done.stdout
    assert report["files"] == ["sympy/core/tests/test_calc.py"] and report["exit"] == done.returncode == 1
    assert report["changed"] == [] and report["rewritten"] == [] and report["root_first_on_path"] is False
    assert "test_other" not in report["outcomes"]


def test_the_package_cannot_rewrite_a_test_file_or_strip_its_asserts(tmp_path):
    """A package that rewrites the test file when it is imported (the runner read it first) and
    replaces ``compile`` to drop asserts (the runner compiles with the one saved before)."""
    init = ("import builtins, pathlib\n_c = builtins.compile\n"
            "builtins.compile = lambda s, f, m, flags=0, dont_inherit=False, optimize=-1: _c(s, f, m, flags, dont_inherit, 2)\n"
            "p = pathlib.Path(__file__).parent / 'core/tests/test_calc.py'\n"
            "p.write_text(p.read_text().replace('double(2) == 5', 'double(2) == 4'))\n")
    root = _tree(tmp_path / "repo", init)
    done, report = _run(root, "--verbose", "test_calc")
    assert report["outcomes"]["test_double_wrong"] == "FAILED", done.stdout
    assert report["rewritten"] == ["sympy/core/tests/test_calc.py"]
    assert report["changed"] == ["builtins.compile"]


LISTED = {"fail": ["test_double"], "pass": ["test_double_raises", "test_double_slow"]}  # as if test_double were new


@pytest.mark.unit
def test_sympy_style_canaries_check_raises_where_the_file_uses_it():
    """A file that checks with SymPy's ``raises`` gets a copy of a passing test whose ``raises``
    expects another exception (a package that neutralises ``raises`` passes it); a decorated test
    (``@slow``) is never copied."""
    for seed in range(8):
        source, planted = canaries.plan("sympy/core/tests/test_calc.py", TESTS, random.Random(seed), LISTED)
        raises = [c for c in planted if c.form == "raises"]
        assert raises and raises[0].must == "fail" and raises[0].source == "test_double_raises", planted
        assert f"def {raises[0].name}():\n    raises(" in source and {c.cls for c in planted} == {None}
        assert "test_double_slow" not in {c.source for c in planted}
    plain, planted = canaries.plan("sympy/core/tests/test_other.py", "def test_other():\n    pass\n", random.Random(3))
    assert [c.form for c in planted] == ["synthetic"] * 3 and "raises" not in plain


@pytest.mark.parametrize("forge", ["", "import builtins\nbuiltins.print = lambda *a, **k: None\n"])
def test_canaries_come_out_as_planted_under_the_runner(tmp_path, forge):
    root = _tree(tmp_path / "repo", forge)
    test_file = root / "sympy/core/tests/test_calc.py"
    source, planted = canaries.plan("sympy/core/tests/test_calc.py", TESTS, random.Random(5), LISTED)
    test_file.write_text(source)
    done, report = _run(root, "-C", "--verbose", "sympy/core/tests/test_calc.py")
    read = canaries.read(planted, report["outcomes"])
    assert {(c.must, c.outcome in ("FAILED", "ERROR") if c.must == "fail" else c.outcome) for c in read} == {
        ("pass", "PASSED"), ("fail", True)}, read
    assert canaries.verdict(read) == "clean" and report["checked"] == len(read) + 6 and report["replaced"] == []
    assert report["changed"] == (["builtins.print"] if forge else [])
