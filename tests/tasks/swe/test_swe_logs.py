"""SWE test logs read by SWE-bench's parsers and by the project's, on real runner output: pytest
run here on parametrized ids with spaces and newlines, SymPy's own reporter run here, Django's
runner recorded (tests/tasks/swe/data/README.md); the test command from SWE-bench's eval scripts;
test lists as JSON strings; and what importing swebench costs the process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prorl_celery.errors import InvalidRequest
from tasks.swe import specs as swe_specs, test_log

DATA = Path(__file__).resolve().parent / "data"
ROOT = Path(__file__).resolve().parents[3]

IDS_TESTS = textwrap.dedent('''
    import pytest

    @pytest.mark.parametrize("src", ["assert 1 == 1", "assert (1,\\n 2)", "x"])
    def test_get_assertion_exprs(src):
        assert src

    @pytest.mark.parametrize("text,n", [("\\n    | **Anti-pattern**", 1), ("plain", 2), ("a - b]", 1)])
    def test_content_count(text, n):
        assert n < 2

    @pytest.mark.parametrize("v", [pytest.param(1, id="explicit id\\nwith newline")])
    def test_explicit(v):
        assert v

    @pytest.mark.xfail
    def test_known_bug():
        assert 0

    @pytest.mark.skip(reason="not here")
    def test_skipped():
        pass
''')
ESCAPED = {
    "t.py::test_get_assertion_exprs[assert 1 == 1]": "PASSED",
    "t.py::test_get_assertion_exprs[assert (1,\\n 2)]": "PASSED",
    "t.py::test_get_assertion_exprs[x]": "PASSED",
    "t.py::test_content_count[\\n    | **Anti-pattern**-1]": "PASSED",
    "t.py::test_content_count[plain-2]": "FAILED",
    "t.py::test_content_count[a - b]-1]": "PASSED",
    "t.py::test_explicit[explicit id\\nwith newline]": "PASSED",
    "t.py::test_known_bug": "PASSED",  # xfail counts as passing, as in SWE-bench
}


def _pytest_log(tmp_path: Path, *options: str) -> str:
    (tmp_path / "t.py").write_text(IDS_TESTS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *options, "t.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert "1 failed" in done.stdout, done.stdout
    return done.stdout


@pytest.fixture(scope="module")
def pytest_log(tmp_path_factory) -> str:
    return _pytest_log(tmp_path_factory.mktemp("ids"))


@pytest.mark.unit
def test_pytest_ids_with_spaces_and_escaped_newlines(pytest_log):
    assert test_log.parse(pytest_log) == ESCAPED


def test_pytest_ids_with_raw_newlines_span_lines(tmp_path):
    log = _pytest_log(tmp_path, "-o", "disable_test_id_escaping_and_forfeit_all_rights_to_community_support=true")
    assert "test_content_count[\n    | **Anti-pattern**-1]" in log  # pytest really broke the line
    raw = {name.replace("\\n", "\n"): status for name, status in ESCAPED.items()}
    assert test_log.parse(log) == raw


@pytest.mark.unit
def test_swebench_pytest_parser_and_the_listed_ids_either_way(pytest_log):
    """SWE-bench's parser (pytest-dev/pytest) keeps the first word of an id; the full ids are added
    beside; a list written with full ids or with SWE-bench's cut ones finds every test."""
    log = pytest_log
    spec = swe_specs.spec_for({"repo": "pytest-dev/pytest", "test_patch": ""})
    assert spec.parser == "parse_log_pytest" and spec.source == "default"
    outcomes = swe_specs.parse(spec, log, {"repo": "pytest-dev/pytest"})
    assert outcomes["t.py::test_get_assertion_exprs[assert"] in ("PASSED",)  # SWE-bench's own key
    for name, status in ESCAPED.items():
        assert test_log.lookup(outcomes, name) == status, name
    cut = {"t.py::test_content_count[\\n": "PASSED", "t.py::test_get_assertion_exprs[assert": "PASSED"}
    for name, status in cut.items():  # as SWE-bench data lists them
        assert test_log.lookup(outcomes, name) == status
        assert test_log.lookup(test_log.parse(log), name) == status  # our parser's full ids match too
    report = test_log.report(outcomes, ["t.py::test_content_count[plain-2]"], list(cut))
    assert report["FAIL_TO_PASS"] == {"t.py::test_content_count[plain-2]": "FAILED"} and not report["resolved"]


@pytest.mark.unit
def test_a_cut_id_whose_full_ids_disagree_is_not_passed():
    outcomes = {"t.py::test_a[x y]": "PASSED", "t.py::test_a[x z]": "FAILED"}
    assert test_log.lookup(outcomes, "t.py::test_a[x") == test_log.MISSING
    assert test_log.lookup(outcomes, "t.py::test_a[q") == test_log.MISSING


@pytest.mark.unit
def test_django_runner_log_both_parsers():
    log = (DATA / "django_discover_v2.log").read_text()
    spec = swe_specs.spec_for({"repo": "django/django", "test_patch": ""})
    assert spec.parser == "parse_log_django"
    outcomes = swe_specs.parse(spec, log, {"repo": "django/django"})
    ours = test_log.parse(log)
    # SWE-bench's Django data spells ids the older Pythons' way: "method (module.Class)"
    expect = {"test_total": "PASSED", "test_discount_broken": "FAILED", "test_error": "ERROR",
              "test_skipped": "SKIPPED"}
    for method, status in expect.items():
        for spelling in (f"{method} (shop.tests.PriceTests)", f"{method} (shop.tests.PriceTests.{method})"):
            assert test_log.lookup(outcomes, spelling) == status, spelling
            assert test_log.lookup(ours, spelling) == status, spelling
    assert outcomes["Rounding keeps two decimals."] == "PASSED"  # a docstring names the test there
    assert ours["shop.tests.PriceTests.test_rounding"] == "PASSED"
    assert ours["shop.tests.PriceTests.test_expected"] == "PASSED"


SYMPY_TESTS = textwrap.dedent('''
    from sympy import Symbol, simplify
    from sympy.testing.pytest import XFAIL, skip

    def test_simplify():
        x = Symbol("x")
        assert simplify(x + x) == 2 * x

    def test_error():
        raise ValueError("boom")

    @XFAIL
    def test_known_bug():
        assert 0

    def test_skipped():
        skip("needs numpy")

    def test_broken():
        assert 1 == 2
''')
SYMPY_RUN = textwrap.dedent('''
    import os, sys
    from sympy.testing.runtests import PyTestReporter, SymPyTests
    tests = SymPyTests(PyTestReporter(verbose=True, colors=False))
    tests._root_dir = os.getcwd()
    tests._testfiles = [os.path.abspath("pkg/tests/test_calc.py")]
    sys.exit(not tests.test(sort=True))  # source order (its default is a random one)
''')


def test_sympy_runner_log_swebench_parser(tmp_path):
    """SymPy's own reporter (what ``bin/test -C --verbose`` prints), read by SWE-bench's parser."""
    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    for init in ("pkg/__init__.py", "pkg/tests/__init__.py"):
        (tmp_path / init).write_text("")
    (tmp_path / "pkg" / "tests" / "test_calc.py").write_text(SYMPY_TESTS)
    done = subprocess.run([sys.executable, "-c", SYMPY_RUN], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    log = done.stdout + done.stderr
    assert "test_simplify ok" in log and done.returncode == 1, log
    spec = swe_specs.spec_for({"repo": "sympy/sympy", "test_patch": ""})
    assert spec.parser == "parse_log_sympy" and spec.test_cmd.startswith(swe_specs.SYMPY)
    outcomes = swe_specs.parse(spec, log, {"repo": "sympy/sympy"})
    assert outcomes["test_simplify"] == "PASSED" and outcomes["test_error"] == "ERROR"
    report = test_log.report(outcomes, ["test_broken", "test_error"], ["test_simplify"])
    assert report["PASS_TO_PASS"] == {"test_simplify": "PASSED"} and not report["resolved"]


# -- the test command ---------------------------------------------------------------------
@pytest.mark.parametrize("name,setup,command", [
    ("pytest_4.5", ["source /opt/miniconda3/bin/activate", "conda activate testbed"],
     "pytest -rA testing/test_assertrewrite.py"),
    ("django_3.0", ["source /opt/miniconda3/bin/activate", "conda activate testbed", "export LANG=en_US.UTF-8",
                    "export LANGUAGE=en_US:en", "export LC_ALL=en_US.UTF-8"],
     "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 auth_tests.test_validators"),
    ("sympy_1.7", ["source /opt/miniconda3/bin/activate", "conda activate testbed"],
     "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose sympy/core/tests/test_basic.py"),
])
@pytest.mark.unit
def test_command_from_swebench_eval_scripts(name, setup, command):
    script = (DATA / f"eval_{name}.sh").read_text()
    spec = swe_specs.spec_for({"repo": "x/y", "eval_script": script})
    assert (spec.source, spec.setup, spec.test_cmd) == ("eval_script", setup, command)


@pytest.mark.unit
def test_default_commands_match_the_eval_scripts():
    """Without an eval script, the runner per repository is the one SWE-bench's scripts use."""
    for name, repo in (("pytest_4.5", "pytest-dev/pytest"), ("django_3.0", "django/django"), ("sympy_1.7", "sympy/sympy")):
        script = (DATA / f"eval_{name}.sh").read_text()
        test_patch = script[script.index("diff --git"):]
        scripted = swe_specs.from_eval_script(script)[1].split()
        ours = swe_specs.spec_for({"repo": repo, "test_patch": test_patch}).test_cmd.split()
        if repo == "pytest-dev/pytest":
            assert ours[:4] == ["python3", "-m", "pytest", "-rA"] and ours[-1] == scripted[-1]
        else:
            assert ours == scripted


@pytest.mark.unit
def test_instance_fields_win_and_unknown_repos_fall_back_to_ours():
    assert swe_specs.spec_for({"repo": "django/django", "test_cmd": "make test"}).test_cmd == "make test"
    unknown = swe_specs.spec_for({"repo": "someone/else", "test_patch": ""})
    assert unknown.parser == swe_specs.PRORL and unknown.test_cmd == swe_specs.PYTEST
    assert swe_specs.spec_for({"repo": "django/django", "log_parser": "prorl"}).parser == swe_specs.PRORL
    assert swe_specs.spec_for({"repo": "x/y", "log_parser": "parse_log_pytest_v2"}).parser == "parse_log_pytest_v2"
    assert swe_specs.test_files("diff --git a/a/t.py b/a/t.py\ndiff --git a/d.json b/d.json\n") == ["a/t.py"]


# -- test lists ---------------------------------------------------------------------------
@pytest.mark.unit
def test_test_lists_as_json_strings():
    names = ["t.py::test_a[x y]", "test_b (m.C)"]
    assert test_log.test_list(json.dumps(names), "instance.FAIL_TO_PASS") == names
    assert test_log.test_list(names, "instance.FAIL_TO_PASS") == names
    assert test_log.test_list("[]", "f") == [] and test_log.test_list(None, "f") == []
    for garbage in ("[not json", '{"a": 1}', "[1, 2]", 7, ["ok", 3], '"one"'):
        with pytest.raises(InvalidRequest) as caught:
            test_log.test_list(garbage, "instance.PASS_TO_PASS")
        assert caught.value.field == "instance.PASS_TO_PASS"


def test_api_refuses_garbage_test_lists_naming_the_field(api):
    import requests

    from prorl_celery.fakes import swe

    instance = {"data_source": "swe", "instance_id": "x", "repo": "fixture/statkit", "problem_statement": "p",
                "base_commit": "0" * 40, "test_patch": "", "FAIL_TO_PASS": "[not json", "PASS_TO_PASS": "[]"}
    assert swe.names()
    for key, value in (("FAIL_TO_PASS", "[not json"), ("PASS_TO_PASS", '{"a": 1}')):
        body = {**instance, "FAIL_TO_PASS": "[]", key: value}
        response = requests.post(f"{api}/jobs", json={"instance": body}, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["field"] == f"instance.{key}"
    response = requests.post(f"{api}/jobs", json={"instance": {**instance, "FAIL_TO_PASS": "[]",
                                                               "base_commit": "HEAD"}}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["field"] == "instance.base_commit"


# -- what swebench costs ------------------------------------------------------------------
def test_swebench_parsers_load_without_docker_modal_or_datasets():
    probe = ("import sys; from tasks.swe import specs as swe_specs; sb = swe_specs._swebench(); "
             "print(sb.version, len(sb.registry), len(sb.by_repo), "
             "sorted(m for m in ('docker', 'modal', 'datasets', 'pandas') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    version, registry, by_repo, heavy = done.stdout.split(" ", 3)
    assert version.startswith("5.") and int(registry) > 40 and int(by_repo) > 40, done.stdout + done.stderr
    assert heavy.strip() == "[]"


def test_the_api_process_does_not_import_swebench():
    probe = ("import sys; from flask_api import create_app; from tasks.swe.handler import SweHandler; "
             "print('swebench' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stdout + done.stderr
