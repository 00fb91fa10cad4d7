"""The SWE grader's integrity parts in process: the allow-list, the configuration the grader
writes for pytest (read back by the real pytest), the command rewrite, canaries and the
log/runner cross-check. The attacks themselves run in tests/security/test_reward_forgery.py."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from tasks.swe import integrity
from tasks.swe.integrity import canaries, tamper
from tasks.swe.runners import pytest_isolation

BASE = {"statkit/__init__.py", "statkit/central.py", "tests/__init__.py", "tests/test_central.py",
        "setup.py", "README.md", "docs/index.rst", "src/other/__init__.py", "src/other/core.py",
        "bench/bench.py", "docs/conf.py", ".github/workflows/ci.yml", "tests/conftest.py", "tox.ini"}


@pytest.mark.parametrize("path,ok", [
    ("statkit/central.py", True), ("statkit/new_module.py", True), ("statkit/sub/__init__.py", True),
    ("src/other/core.py", True), ("docs/index.rst", True), ("CHANGELOG.rst", True), ("setup.py", True),
    ("requirements-dev.txt", True), ("bench/bench.py", True), ("docs/conf.py", True),
    ("statkit/conftest.py", False), ("conftest.py", False), ("pytest.py", False), ("_pytest/__init__.py", False),
    (".pytest.ini", False), ("pytest.toml", False), (".pytest.toml", False), (".env", False),
    ("statkit/.hidden.py", False), ("statkit/x.pth", False), ("forge-1.0.dist-info/entry_points.txt", False),
    ("statkit/forge.egg-info/entry_points.txt", False), ("sitecustomize.py", False), ("tests/__init__.py", False),
    ("docs/other_conf.py", False), ("bench/new.py", False), (".github/workflows/ci.yml", False),
    ("tests/conftest.py", False), ("tox.ini", False), ("bin/test", False), ("Makefile", False), ("tomllib.py", False),
])
@pytest.mark.unit
def test_allow_list(path, ok):
    assert tamper.allowed(path, tamper.package_roots(BASE), BASE) is ok


@pytest.mark.unit
def test_the_files_a_test_command_names_are_the_runners():
    base = BASE | {"bin/test", "sympy/__init__.py", "sympy/core/basic.py"}
    changed = {"bin/test", "sympy/core/basic.py"}
    assert tamper.flagged(changed, set(), base, set(), set(), "") == []  # bin/test: a file the base had
    assert tamper.flagged(changed, set(), base, set(), set(), "PYTHONWARNINGS='x' bin/test -C --verbose") == ["bin/test"]
    assert tamper.flagged({"tests/runtests.py"}, set(), base, set(), set(), "./tests/runtests.py x") == ["tests/runtests.py"]


@pytest.mark.unit
def test_flagged_adds_test_patch_paths_sections_and_links():
    changed = {"statkit/central.py", "statkit/link.py", "pyproject.toml", "statkit/data.json"}
    assert tamper.flagged(changed, {"statkit/data.json"}, BASE, {"pyproject.toml"}, {"statkit/link.py"}) == [
        "pyproject.toml", "statkit/data.json", "statkit/link.py"]


@pytest.mark.parametrize("text", [
    "[tool.pytest.ini_options]\naddopts = '-p x'\n",
    "[tool]\n\"pytest\".ini_options.addopts = '-p x'\n",
    "[tool]\npytest = { ini_options = { addopts = '-p x' } }\n",
    "[tool.'pytest']\naddopts = ['-p', 'x']\n",
])
@pytest.mark.unit
def test_pyproject_test_sections_however_spelt(text):
    base = "[project]\nname = 'a'\n"
    assert tamper.test_sections("pyproject.toml", base) != tamper.test_sections("pyproject.toml", base + text)
    assert tamper.test_sections("pyproject.toml", base) == tamper.test_sections(
        "pyproject.toml", base.replace("'a'", "'b'") + "[tool.black]\nline-length = 99\n")


def _config_of(files: dict[str, str]) -> tuple[str | None, str]:
    return pytest_isolation.base_config(files.get)


@pytest.mark.parametrize("files,source", [
    ({"setup.cfg": "[metadata]\nname = a\n[tool:pytest]\naddopts = -q\nmarkers =\n    slow: s\n"}, "setup.cfg"),
    ({"tox.ini": "[tox]\nenvlist = py\n", "setup.cfg": "[tool:pytest]\naddopts = -q\n"}, "setup.cfg"),
    ({"pyproject.toml": "[tool.pytest.ini_options]\naddopts = ['-q', '-m', 'not slow']\n"
                        "markers = ['slow: s']\n"}, "pyproject.toml"),
    ({"pytest.ini": "[pytest]\naddopts = -q\n", "pyproject.toml": "[tool.pytest.ini_options]\naddopts='-x'\n"}, "pytest.ini"),
    ({}, None),
])
def test_the_grader_config_says_what_the_base_config_said(tmp_path, files, source):
    """Read back by the real pytest: the options of the base's own config, from the grader's file."""
    found, text = _config_of(files)
    assert found == source
    ini = tmp_path / ".prorl-pytest-x.ini"
    ini.write_text(text)
    probe = ("import pytest, sys\nclass P:\n    def pytest_configure(self, config):\n"
             "        print('ADDOPTS', config.getini('addopts'), 'MARKERS', config.getini('markers'))\n"
             "        sys.exit(0)\npytest.main(['-c', sys.argv[1], '--rootdir', sys.argv[2], '-p', 'no:cacheprovider'], plugins=[P()])\n")
    out = subprocess.run([sys.executable, "-c", probe, str(ini), str(tmp_path)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}).stdout
    if source is None:
        assert "ADDOPTS [] MARKERS []" in out, out
    elif "not slow" in str(files):
        assert "ADDOPTS ['-q', '-m', 'not slow'] MARKERS ['slow: s']" in out, out
    else:
        assert "ADDOPTS ['-q']" in out, out


@pytest.mark.parametrize("command,count", [
    ("python3 -m pytest -rA tests/t.py", 1), ("pytest -rA tests/t.py", 1), ("python -m pytest x", 1),
    ("noise; python3 -m pytest -rA tests; noise", 1), ("A=1 B=2 pytest x && pytest y", 2),
    ("./tests/runtests.py --verbosity 2 x", 0), ("python3 -m pytest_other x", 0), ("echo pytest is here", 0),
])
@pytest.mark.unit
def test_rewrite_finds_each_pytest_run(command, count):
    rewritten, found = pytest_isolation.rewrite(command, lambda python, i: f"RUN{i}[{python}]")
    assert found == count, rewritten
    assert rewritten.count("RUN") == count and ("pytest " not in rewritten.replace("pytest_other", "")
                                                or count == 0 or "echo" in command)


CENTRAL = ("import unittest\n\nfrom statkit import mean, median\n\n\nclass CentralTest(unittest.TestCase):\n"
           "    def test_mean(self):\n        self.assertEqual(mean([1, 2, 3, 4]), 2.5)\n\n"
           "    def test_median_odd(self):\n        self.assertEqual(median([3, 1, 2]), 2)\n\n"
           "    def test_median_even_pair(self):\n        self.assertEqual(median([4, 1, 3, 2]), 2.5)\n")
CENTRAL_LISTED = {"fail": ["tests.test_central.CentralTest.test_median_even_pair"],
                  "pass": ["tests.test_central.CentralTest.test_mean", "tests.test_central.CentralTest.test_median_odd"]}


@pytest.mark.unit
def test_canaries_are_the_files_own_tests_copied_renamed_and_placed_among_them():
    """No template: each canary is a listed test of the file (a must-fail one changed at one
    assertion, the first of them a FAIL_TO_PASS test), named with the file's words, put among the
    tests of its own class; seeds give different names, forms and places."""
    texts, forms = set(), set()
    for seed in range(12):
        text, made = canaries.plan("tests/test_central.py", CENTRAL, random.Random(seed), CENTRAL_LISTED)
        compile(text, "tests/test_central.py", "exec")  # still Python
        assert "len('abc')" not in text and text.count("class ") == 1, text
        assert {c.cls for c in made} == {"CentralTest"} and all(f"    def {c.name}(self):" in text for c in made)
        assert all(set(c.name.split("_")[1:]) <= {"mean", "median", "odd", "even", "pair"} for c in made), made
        fails = [c for c in made if c.must == "fail"]
        assert fails[0].source == "test_median_even_pair" and len(fails) >= 2, made
        assert [c.form for c in made if c.must == "pass"] == ["copy"] * 2 and all(c.source for c in made)
        copy = next(c for c in made if c.must == "pass")
        assert f"    def {copy.name}(self):\n        self.assertEqual(" in text
        texts.add(text)
        forms |= {c.form for c in fails}
    assert len(texts) == 12 and forms == {"literal", "negated"}
    plain, made = canaries.plan("tests/test_p.py", "def test_parse_value():\n    assert 1\n", random.Random(2))
    assert all(c.cls is None and c.form == "synthetic" and f"def {c.name}():" in plain for c in made)


@pytest.mark.unit
def test_canary_names_are_unique_in_a_file_of_one_word():
    """A file whose test names give one word ("value") runs out of plain names at once: the numbered
    names that follow are never one already planted (a second def of a name hides the first, and its
    must-pass canary read as failed: the CI run that lost a clean answer to ``unverified``)."""
    text = ("import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n\n"
            "    def test_value(self):\n        import lib\n        self.assertEqual(lib.value(), 2)\n")
    listed = {"fail": ["tests.test_m.T.test_value"], "pass": ["tests.test_m.T.test_ok"]}
    for seed in range(400):
        planted, made = canaries.plan("tests/test_m.py", text, random.Random(seed), listed)
        names = [c.name for c in made]
        assert len(set(names)) == len(names), (seed, names)
        defs = [line.split("(")[0] for line in planted.splitlines() if line.lstrip().startswith("def ")]
        assert len(set(defs)) == len(defs), (seed, defs)


@pytest.mark.unit
def test_a_changed_copy_of_a_failing_test_proves_nothing():
    """A must-fail canary that passed is a forgery only where the test it copies did not fail (a
    negated assertion passes where the original's assertion fails: the answer never fixed it)."""
    def planted(source_outcome: str) -> list:
        return [canaries.Canary(file="t.py", name="test_a", must="pass", outcome="PASSED", source="test_x",
                                source_outcome="PASSED"),
                canaries.Canary(file="t.py", name="test_b", must="fail", outcome="PASSED", form="negated",
                                source="test_y", source_outcome=source_outcome)]
    assert canaries.verdict(planted("FAILED")) == "clean"
    assert canaries.verdict(planted("PASSED")) == canaries.verdict(planted("MISSING")) == "tampered"
    broke = [canaries.Canary(file="t.py", name="test_a", must="pass", outcome="FAILED", source="test_x",
                             source_outcome="FAILED")]
    assert canaries.verdict(broke) == "clean"  # the answer broke the test it copies: its own reward says so
    assert canaries.verdict([broke[0].model_copy(update={"source_outcome": "PASSED"})]) == "unverified"


@pytest.mark.unit
def test_canary_verdicts():
    def planted(first: str, failing: str, last: str, expected: bool = True) -> list:
        return [canaries.Canary(file="t.py", name="test_a", must="pass", outcome=first, expected=expected),
                canaries.Canary(file="t.py", name="test_b", must="fail", outcome=failing, expected=expected),
                canaries.Canary(file="t.py", name="test_c", must="pass", outcome=last, expected=expected)]

    assert canaries.verdict(planted("PASSED", "FAILED", "PASSED")) == "clean"
    assert canaries.verdict(planted("PASSED", "PASSED", "PASSED")) == "tampered"
    assert canaries.verdict(planted("MISSING", "PASSED", "MISSING", expected=False)) == "tampered"
    assert canaries.verdict(planted("MISSING", "MISSING", "MISSING")) == "unverified"
    assert canaries.verdict(planted("MISSING", "MISSING", "MISSING", expected=False)) == "clean"
    assert canaries.verdict(planted("ERROR", "FAILED", "PASSED")) == "unverified"
    assert canaries.verdict(planted("PASSED", "MISSING", "MISSING")) == "clean"  # a parser lost the last lines
    assert canaries.verdict(planted("SKIPPED", "SKIPPED", "SKIPPED")) == "clean"  # a module-level skip mark
    assert [p for p in ("tests/test_a.py", "t/b_test.py", "tests/app/tests.py", "tests/conftest.py",
                        "tests/app/models.py", "tests/helpers.py") if canaries.is_test_module(p)] == [
        "tests/test_a.py", "t/b_test.py", "tests/app/tests.py"]


@pytest.mark.unit
def test_cross_check_believes_a_pass_only_the_runner_saw():
    log = {"t.py::a": "PASSED", "t.py::b": "PASSED", "t.py::c": "PASSED", "t.py::d": "FAILED"}
    runner = {"t.py::a": "PASSED", "t.py::b": "FAILED", "t.py::c": "ERROR", "t.py::d": "FAILED"}
    merged, forged = integrity.cross_check(log, runner)
    assert merged == {"t.py::a": "PASSED", "t.py::b": "FAILED", "t.py::c": "ERROR", "t.py::d": "FAILED"}
    assert forged == ["t.py::b"]
    assert integrity.cross_check({"t.py::e": "PASSED"}, {})[1] == ["t.py::e"]


SYMPY_FILE = "from sympy import Symbol\n\n\ndef test_double_symbol():\n    x = Symbol('x')\n    assert x + x == 2 * x\n\n\n" \
             "def test_double_broken():\n    assert 1 == 2\n\n\ndef test_double_last():\n    pass\n"  # the parser may lose the last
SYMPY_RUN = ("import os, sys\nfrom sympy.testing.runtests import PyTestReporter, SymPyTests\n{forge}\n"
             "tests = SymPyTests(PyTestReporter(verbose=True, colors=False))\ntests._root_dir = os.getcwd()\n"
             "tests._testfiles = [os.path.abspath('pkg/tests/test_calc.py')]\nsys.exit(not tests.test(sort=True))\n")
# canaries go anywhere among the tests, the last place included, and the parser may lose the last
# test of a file: a test after whatever was planted keeps every canary readable
TAIL = "\n\ndef test_tail_after_the_canaries():\n    pass\n"
# a reporter that calls every failure a pass (what a package could do to SymPy's runner in process)
SYMPY_FORGE = "PyTestReporter.test_fail = lambda self, exc_info: self.test_pass()"


@pytest.mark.parametrize("forge,expected", [("", "clean"), (SYMPY_FORGE, "tampered")])
def test_canaries_in_sympys_own_runner(tmp_path, forge, expected):
    """Canaries planted in a SymPy-style test file, run by SymPy's own reporter (what ``bin/test
    --verbose`` prints), read by SWE-bench's SymPy parser: as planted, or caught forging."""
    pytest.importorskip("sympy")
    from tasks.swe import specs as swe_specs

    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    for init in ("pkg/__init__.py", "pkg/tests/__init__.py"):
        (tmp_path / init).write_text("")
    planted = integrity.plant({"pkg/tests/test_calc.py": SYMPY_FILE}, f"{swe_specs.SYMPY} pkg/tests/test_calc.py",
                              lambda path, text: (tmp_path / path).write_text(text + TAIL))
    assert all(c.expected and c.cls is None for c in planted)
    done = subprocess.run([sys.executable, "-c", SYMPY_RUN.format(forge=forge)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    spec = swe_specs.spec_for({"repo": "sympy/sympy", "test_patch": ""})
    outcomes = swe_specs.parse(spec, done.stdout + done.stderr, {"repo": "sympy/sympy"})
    assert outcomes["test_double_broken"] == ("FAILED" if not forge else "PASSED"), done.stdout[-2000:]
    assert canaries.verdict(canaries.read(planted, outcomes)) == expected
