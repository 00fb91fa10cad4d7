"""Issue 23 on Django's runner: forged rewards on a real row, ``django__django-16255``.

The real SWE grader (``tasks.swe.grader.grade``) grades each forged patch in a real bwrap
sandbox in the row's own environment (built from its recipe, or found in the environment cache),
where the checkout is the one ``pip install -e .`` installed, and the test command is SWE-bench's:
``./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 <modules>``. Django's runner
(``DiscoverRunner``, its result classes, ``SimpleTestCase``) is the package's own code, so every
forgery here is one a patch may legally write in ``django/`` except where a path is flagged. Each
must earn 0 with a typed outcome (``tampered`` naming the path, canary or log line, or
``unverified`` with an error); the gold patch, graded in the same sandbox, earns 1 with a clean
integrity block and the canaries as planted. Marked ``swebench`` (the environment is built once,
then cached; ~5 s a case): ``python3 -m pytest -m swebench tests/security/test_reward_forgery_django.py``.
Before the recorder, four of these earned 1 on the log alone: the listed test's "ok" line printed
at import or by an ``atexit`` hook, a result class that turns only its error into a success, and
``SimpleTestCase.run`` replaced (the canaries, plain ``unittest.TestCase``, stayed honest).
Issue 32's profile/``__code__`` family (:mod:`tests.security.hostile_graders`) is caught by the
recorder's watch, the canaries now copies of the file's own listed tests.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tasks.swe import grader as swe_eval
from tests.helpers import reachable_tmpdir
from tests.security import hostile_graders
from tests.security.swe_rows import row_with_forgeries

ROW = "django__django-16255"
F2P = "test_callable_sitemod_no_items (sitemaps_tests.test_http.HTTPSitemapTests)"
pytestmark = [pytest.mark.swebench, pytest.mark.timeout(1800),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]

# -- the forgeries: path -> text appended to it ("=" in front: the whole new file) ---------------
# the result class Django's runner reports to turns every failure and error into a success
RESULTS_ALL_OK = '''
import unittest as _u
def _ok(self, test, err=None):
    _u.TextTestResult.addSuccess(self, test)
_u.TextTestResult.addError = _ok
_u.TextTestResult.addFailure = _ok
'''
# ... or only those of the listed test (it knows the name): the canaries stay honest
RESULTS_LISTED_OK = '''
def _listed_ok(cls):
    error = cls.addError
    def addError(self, test, err):
        if "no_items" in str(test):
            return self.addSuccess(test)
        return error(self, test, err)
    cls.addError = addError
    return cls
from django.test.runner import DiscoverRunner
DiscoverRunner.get_resultclass = (lambda self, _g=DiscoverRunner.get_resultclass:
                                  _listed_ok(type("Forged", (_g(self) or __import__("unittest").TextTestResult,), {})))
'''
ALWAYS_OK = '''
import unittest as _u
def _always_ok(self, result=None):
    result.startTest(self)
    result.addSuccess(self)
    result.stopTest(self)
_u.TestCase.run = _always_ok
'''
# Django's own SimpleTestCase (package code) skips the test and reports a success
SIMPLE_TESTCASE_OK = '''
from django.test import SimpleTestCase
def _run_ok(self, result=None):
    result.startTest(self)
    result.addSuccess(self)
    result.stopTest(self)
SimpleTestCase.run = _run_ok
'''
# the listed test's "... ok" line, in the spelling the row lists, printed when the package loads
FAKE_OK_LINE = f'\nprint("{F2P} ... ok", flush=True)\n'
PRINT_AND_EXIT = f'''
import os as _os, sys as _sys
if "runtests.py" in " ".join(_sys.argv):
    print("{F2P} ... ok", flush=True)
    _os._exit(0)
'''
ATEXIT = f'''
import atexit as _atexit, os as _os, sys as _sys
_os._exit = lambda code=0: _sys.exit(0)
_atexit.register(lambda: print("\\n{F2P} ... ok", flush=True))
'''

FORGERIES = {
    "runtests-py-edited": {"tests/runtests.py": "\nimport sys\nsys.exit(0)\n"},
    "test-settings-edited": {"tests/test_sqlite.py": "\nTEST_RUNNER = 'django.forge.Runner'\n"},
    "root-module-shadows-unittest": {"unittest.py": "=raise SystemExit(0)\n"},
    "pth-imports-a-forgery": {"django/zz_forge.pth": "=import django.forge\n", "django/forge.py": "=" + ALWAYS_OK},
    "runner-py-edited": {"django/test/runner.py": RESULTS_LISTED_OK},
    "result-class-all-ok": {"django/__init__.py": RESULTS_ALL_OK},
    "result-class-listed-test-ok": {"django/contrib/sitemaps/__init__.py": RESULTS_LISTED_OK},
    "unittest-run-patched-at-import": {"django/__init__.py": ALWAYS_OK},
    "simpletestcase-run-skips-tests": {"django/contrib/sitemaps/__init__.py": SIMPLE_TESTCASE_OK},
    "fake-ok-line-printed": {"django/contrib/sitemaps/__init__.py": FAKE_OK_LINE},
    "print-ok-then-os-exit": {"django/__init__.py": PRINT_AND_EXIT},
    "atexit-ok-after-a-patched-exit": {"django/__init__.py": ATEXIT},
}
# issue 32 item 7: the profile/__code__ family (tests/security/hostile_graders.py)
FAMILY = hostile_graders.family([F2P.split(" ", 1)[0]])
FORGERIES.update({name: {"django/__init__.py": text} for name, text in FAMILY.items()})
FLAGGED = {"runtests-py-edited": ["tests/runtests.py"], "test-settings-edited": ["tests/test_sqlite.py"],
           "root-module-shadows-unittest": ["unittest.py"], "pth-imports-a-forgery": ["django/zz_forge.pth"],
           "runner-py-edited": ["django/test/runner.py"]}  # django/test/ is test infrastructure by name
# forged only in the log: the record of the runner says otherwise
LOG_FORGED = {"result-class-listed-test-ok", "fake-ok-line-printed"}
# the runner's record cannot be kept (no report, or its machinery replaced): not believed
UNVERIFIED = {"print-ok-then-os-exit", "unittest-run-patched-at-import"}
# the report comes first and the process ends with the os._exit saved before the package loaded
DEFEATED = {"atexit-ok-after-a-patched-exit"}


@pytest.fixture(scope="module")
def django_row(tmp_path_factory):
    """The row as a SWE instance (its environment built or found), and its forged patches."""
    return row_with_forgeries(tmp_path_factory, ROW, FORGERIES, "django/contrib/sitemaps/__init__.py")


@pytest.fixture(scope="module")
def grade(django_row):
    """grade(patch) -> result, in one bwrap sandbox in the row's environment; the checkout is the
    installed one (the recipe's workdir), put back to the base commit before each grade."""
    from sandboxes.base import SandboxSpec
    from sandboxes.runtimes.bwrap import BwrapSandbox
    from tasks.swe import repo
    from tests.real.test_swebench import recipe_of

    instance, _ = django_row
    workdir = recipe_of(ROW, instance["repo_source"]).workdir
    root = next(reachable_tmpdir("prorl-test-forgery-django-"))
    box = BwrapSandbox(SandboxSpec(image=instance["image"]), "forgery-django", {"root": str(root)})
    where = repo.checkout_into(box, instance, workdir)

    def run(patch: str) -> dict:
        box.exec(f"cd {where} && git reset -q --hard {instance['base_commit']} && git clean -qfdx", timeout=300)
        return swe_eval.grade(box, where, instance, patch, 900)

    yield run
    box.close()
    subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.fixture(scope="module")
def gold(django_row, grade):
    return grade(django_row[0]["patch"])


def test_gold_patch_earns_one_with_a_clean_integrity_block(gold):
    info = gold["eval"]["integrity"]
    assert gold["reward"] == 1.0 and gold["resolved"] is True, (gold["eval"].get("error"), info)
    assert info["outcome"] == "clean" and gold["eval"]["tampered"] == [], info
    assert info["paths"]["flagged"] == [] and info["paths"]["changed"] == ["django/contrib/sitemaps/__init__.py"]
    assert info["runner"]["kind"] == "django-guarded" and info["runner"]["changed"] == [], info["runner"]
    assert {c["outcome"] for c in info["canaries"] if c["must"] == "pass"} == {"PASSED"}, info["canaries"]
    assert {c["outcome"] for c in info["canaries"] if c["must"] == "fail"} <= {"FAILED", "ERROR"}, info["canaries"]
    assert {c["cls"] for c in info["canaries"] if c["form"] != "synthetic"} <= {"HTTPSitemapTests", "DeprecatedTests"}
    assert info["code"]["hooks"] == info["code"]["replaced"] == [] and info["code"]["checked"] >= 37, info["code"]
    assert gold["eval"]["FAIL_TO_PASS"] == {F2P: "PASSED"}


def test_the_bug_left_in_place_earns_nothing_and_is_clean(django_row, grade):
    """The control: a no-op change to the package is graded clean, the listed test failing."""
    result = grade(django_row[1]["(no-op)"])
    info = result["eval"]["integrity"]
    assert result["reward"] == 0.0 and info["outcome"] == "clean", info
    assert result["eval"]["FAIL_TO_PASS"][F2P] in ("FAILED", "ERROR"), result["eval"]["log_tail"]


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forgery_earns_nothing(django_row, grade, gold, name):
    result = grade(django_row[1][name])
    report, info = result["eval"], result["eval"].get("integrity", {})
    assert result["reward"] == 0.0 and result["resolved"] is False, report
    if name in FLAGGED:
        assert info["outcome"] == "tampered" and report["tampered"] == FLAGGED[name], report
    elif name in UNVERIFIED:
        assert info["outcome"] in ("unverified", "tampered") and report.get("error"), info
    elif name in DEFEATED:
        assert info["outcome"] == "clean" and report["FAIL_TO_PASS"][F2P] != "PASSED", report
    elif name in FAMILY:
        hostile_graders.check(name, result, F2P.split(" ", 1)[0])
    elif name in LOG_FORGED:
        assert info["outcome"] == "tampered", info  # the log's spelling: m (mod.Class.m) from Python 3.11
        assert any(t.startswith(f"log:{F2P[:-1]}") for t in report["tampered"]), report["tampered"]
    else:
        assert info["outcome"] == "tampered", info
        assert any(t.startswith(("canary:", "log:")) for t in report["tampered"]), report["tampered"]
    assert gold["reward"] == 1.0 and gold["eval"]["integrity"]["outcome"] == "clean"



def test_no_shape_spares_the_canaries_without_the_listed_test(django_row):
    """The canaries are the file's own tests copied: a forgery that spares code of their shape
    (the old template's, pure builtins, a twin of another test) spares the listed test with them."""
    hostile_graders.row_cannot_spare(django_row[0], "tests/sitemaps_tests/test_http.py", "HTTPSitemapTests." + F2P.split(" ", 1)[0])
