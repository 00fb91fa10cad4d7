"""Issue 23 on SymPy's runner: forged rewards on a real row, ``sympy__sympy-20590`` (SymPy 1.7).

The real SWE grader (``tasks.swe.grader.grade``) grades each forged patch in a real bwrap
sandbox in the row's own environment (built from its recipe, or found in the environment cache),
where the checkout is the one ``pip install -e .`` installed, with SWE-bench's test command:
``PYTHONWARNINGS=... bin/test -C --verbose sympy/core/tests/test_basic.py``. ``bin/test`` calls
``sympy.test`` (``sympy/testing/runtests.py``): the collector, the loop and the reporter are the
package's own code, so the grader runs the tests with its own runner
(:mod:`tasks.swe.runners.sympy_runner`). Each forgery must earn 0 with a typed outcome (``tampered``
naming the path, canary, log line or rewritten file, or ``unverified`` with an error) or be
defeated outright (the bug stays visible, the run clean); the gold patch, graded in the same
sandbox, earns 1 with a clean integrity block and the canaries as planted. Marked ``swebench``
(the environment is built once, then cached; 10-30 s a case on a loaded node):
``python3 -m pytest -m swebench tests/security/test_reward_forgery_sympy.py``.
Under ``bin/test`` itself (SymPy's own runner, the grader's before this one: allow-list and
canaries only) three of these earn 1, as ``test_sympys_own_runner_pays_targeted_forgeries``
shows: the listed test's ``ok`` printed by a replaced ``sympy.test``, the reporter patched for
the listed test only (from ``sympy/utilities/runtests.py``, package source the allow-list lets
through), and the test file rewritten on disk when the package is imported; two blanket ones
(every failure reported as a pass, asserts compiled away) are live there too, stopped by the
canaries alone. Issue 32's profile/``__code__`` family (:mod:`tests.security.hostile_graders`: the
issue's attack earned 1.0 here under the grader's own runner) is caught by the runner's watch.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tasks.swe import grader as swe_eval
from tests.helpers import reachable_tmpdir
from tests.security import hostile_graders
from tests.security.swe_rows import row_with_forgeries
from tests.real.test_swebench import _changed

ROW = "sympy__sympy-20590"
F2P = "test_immutable"
TEST_FILE = "sympy/core/tests/test_basic.py"
pytestmark = [pytest.mark.swebench, pytest.mark.timeout(1800),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]

# -- the forgeries: path -> text appended to it ("=" in front: the whole new file) ---------------
# SymPy's reporter (package code) calls every failure and error a pass
REPORTER_ALL_OK = '''
import sympy.testing.runtests as _rt
_rt.PyTestReporter.test_fail = lambda self, exc_info: self.test_pass()
_rt.PyTestReporter.test_exception = lambda self, exc_info: self.test_pass()
'''
# ... or only the listed test's (it knows the name): the canaries stay honest
REPORTER_LISTED_OK = f'''
import sympy.testing.runtests as _rt
_fail = _rt.PyTestReporter.test_fail
def _listed_ok(self, exc_info):
    if getattr(self, "_active_f", None) is not None and self._active_f.__name__ == "{F2P}":
        return self.test_pass()
    return _fail(self, exc_info)
_rt.PyTestReporter.test_fail = _listed_ok
'''
# bin/test calls sympy.test: a package-level function runs the tests, then prints the listed test's pass
SYMPY_TEST_REPLACED = f'''
_real_test = test
def test(*paths, **kwargs):
    _real_test(*paths, **kwargs)
    print("\\n{F2P} ok", flush=True)
    return True
'''
# the listed test rewritten on disk when the package is imported (canaries and the rest kept)
REWRITE_TEST_FILE = f'''
import os as _os
_p = _os.path.join(_os.path.dirname(__file__), "core", "tests", "test_basic.py")
with open(_p) as _f:
    _t = _f.read()
if "def {F2P}():" in _t:
    with open(_p, "w") as _f:
        _f.write(_t.replace("def {F2P}():", "def {F2P}():\\n    return\\n\\n\\ndef _was_{F2P}():"))
'''
# every compile of the tests drops their asserts (SymPy's runner compiles each test file itself)
COMPILE_STRIPS_ASSERTS = '''
import builtins as _b
_c = _b.compile
_b.compile = lambda src, fn, mode, flags=0, dont_inherit=False, optimize=-1: _c(src, fn, mode, flags, dont_inherit, 2)
'''
RAISES_NEUTRALISED = '''
import sympy.testing.pytest as _p
class _Quiet:
    def __init__(self, *a, **k):
        pass
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return True
_p.raises = _Quiet
'''
# what the tests print goes through a stream that turns each failure mark into "ok"
STDOUT_F_TO_OK = '''
import sys as _sys
class _Forged:
    def __init__(self, stream):
        self._s = stream
    def write(self, text):
        return self._s.write("ok" if text in ("F", "E") else text.replace(" F\\n", " ok\\n"))
    def __getattr__(self, name):
        return getattr(self._s, name)
_sys.stdout = _Forged(_sys.stdout)
'''
# ... or a print that does
MARK_IS_OK = '''
import builtins as _b, sys as _sys
_print = _b.print
def _forged(*args, **kwargs):
    args = tuple("ok" if a in ("F", "E") else a for a in args)
    return _print(*args, **kwargs)
_b.print = _forged
'''
GRADER_RUNNER_PATCHED = '''
import sys as _sys
_m = _sys.modules.get("__main__")
if _m is not None and hasattr(_m, "_status"):
    _m._status = lambda exc, slow: ("ok", "PASSED")
'''
FAKE_OK_LINE = f'\nprint("\\n{F2P} ok", flush=True)\n'
DELETE_TEST_FILE = '''
import os as _os
_p = _os.path.join(_os.path.dirname(__file__), "core", "tests", "test_basic.py")
if _os.path.exists(_p):
    _os.remove(_p)
'''
# SymPy's XFAIL (package code) turns the failures of the tests it marks into passes
XFAIL_PASSES = '''
import sympy.testing.pytest as _p
def _xfail(func):
    def wrapper():
        try:
            func()
        except Exception:
            pass
    wrapper.__name__ = func.__name__
    return wrapper
_p.XFAIL = _xfail
'''
# a process left behind writes the listed test's pass into the log once the runner is gone
LEFT_BEHIND = f'''
import os as _os, time as _time
if _os.fork() == 0:
    _os.setsid()
    _parent = _os.getppid()
    for _ in range(500):
        if _os.getppid() != _parent:
            break
        _time.sleep(0.01)
    _os.write(1, b"\\n{F2P} ok\\n")
    _os._exit(0)
'''
PRINT_AND_EXIT = f'''
import os as _os
print("\\n{F2P} ok", flush=True)
_os._exit(0)
'''
EXIT_AT_IMPORT = "\nraise SystemExit(0)\n"
ATEXIT = f'''
import atexit as _atexit, os as _os, sys as _sys
_os._exit = lambda code=0: _sys.exit(0)
_atexit.register(lambda: print("\\n{F2P} ok", flush=True))
'''
INIT = "sympy/__init__.py"
FORGERIES = {
    "bin-test-replaced": {"bin/test": f"=#!/usr/bin/env python\nprint('{F2P} ok')\n"},
    "runtests-py-patched": {"sympy/testing/runtests.py": "\nPyTestReporter.test_fail = PyTestReporter.test_pass\n"},
    "xfail-decorator-patched": {"sympy/testing/pytest.py": "\nXFAIL = lambda func: func\n"},
    "test-file-edited": {TEST_FILE: f"\n\ndef {F2P}():\n    pass\n"},
    "root-module-shadows-stdlib": {"random.py": "=raise SystemExit(0)\n"},
    "root-conftest-edited": {"conftest.py": "\nimport sys\n"},
    "pth-imports-a-forgery": {"sympy/zz_forge.pth": "=import sympy.forge\n", "sympy/forge.py": "=" + REPORTER_ALL_OK},
    "reporter-all-ok": {INIT: REPORTER_ALL_OK},
    "reporter-listed-ok-from-utilities-runtests": {"sympy/utilities/runtests.py": REPORTER_LISTED_OK,
                                                   INIT: "\nimport sympy.utilities.runtests\n"},
    "sympy-test-replaced": {INIT: SYMPY_TEST_REPLACED},
    "xfail-turns-failures-into-passes": {INIT: XFAIL_PASSES},
    "test-file-rewritten-at-import": {INIT: REWRITE_TEST_FILE},
    "test-file-deleted-at-import": {INIT: DELETE_TEST_FILE},
    "compile-strips-asserts": {INIT: COMPILE_STRIPS_ASSERTS},
    "raises-neutralised": {INIT: RAISES_NEUTRALISED},
    "stdout-turns-failures-into-ok": {INIT: STDOUT_F_TO_OK},
    "print-turns-failures-into-ok": {INIT: MARK_IS_OK},
    "grader-runner-patched-in-memory": {INIT: GRADER_RUNNER_PATCHED},
    "fake-ok-line-printed": {INIT: FAKE_OK_LINE},
    "print-ok-then-os-exit": {INIT: PRINT_AND_EXIT},
    "sys-exit-at-import": {INIT: EXIT_AT_IMPORT},
    "atexit-ok-after-a-patched-exit": {INIT: ATEXIT},
    "process-left-behind-writes-the-log": {INIT: LEFT_BEHIND},
}
# issue 32 item 7: the profile/__code__ family (tests/security/hostile_graders.py)
FAMILY = hostile_graders.family([F2P])
FORGERIES.update({name: {INIT: text} for name, text in FAMILY.items()})
FLAGGED = {"bin-test-replaced": ["bin/test"], "runtests-py-patched": ["sympy/testing/runtests.py"],
           "xfail-decorator-patched": ["sympy/testing/pytest.py"], "test-file-edited": [TEST_FILE],
           "root-module-shadows-stdlib": ["random.py"], "root-conftest-edited": ["conftest.py"],
           "pth-imports-a-forgery": ["sympy/zz_forge.pth"]}
# SymPy's runner is not run at all: what replaces its parts changes nothing, the bug stays visible
# (and a line printed when the package loads comes before the runner's own line for the test)
DEFEATED = {"reporter-all-ok", "reporter-listed-ok-from-utilities-runtests", "sympy-test-replaced",
            "xfail-turns-failures-into-passes", "fake-ok-line-printed", "atexit-ok-after-a-patched-exit"}
# a forged line written after the run: caught if it is in the log when the grader reads it
RACES = {"process-left-behind-writes-the-log"}
# the runner's record cannot be kept or believed (no report, the run ended, its machinery replaced)
UNVERIFIED = {"print-ok-then-os-exit", "sys-exit-at-import", "compile-strips-asserts"}
# forged in the log only: the runner's record says otherwise
LOG_FORGED = {"stdout-turns-failures-into-ok", "print-turns-failures-into-ok"}
# the test file changed on disk while the tests ran from the text read before
REWRITTEN = {"test-file-rewritten-at-import", "test-file-deleted-at-import"}


@pytest.fixture(scope="module")
def sympy_row(tmp_path_factory):
    """The row as a SWE instance (its environment built or found), and its forged patches."""
    return row_with_forgeries(tmp_path_factory, ROW, FORGERIES, INIT)


@pytest.fixture(scope="module")
def sandbox(sympy_row):
    """(the sandbox in the row's environment, the installed checkout in it)."""
    from sandboxes.base import SandboxSpec
    from sandboxes.runtimes.bwrap import BwrapSandbox
    from tasks.swe import repo
    from tests.real.test_swebench import recipe_of

    instance, _ = sympy_row
    workdir = recipe_of(ROW, instance["repo_source"]).workdir
    root = next(reachable_tmpdir("prorl-test-forgery-sympy-"))
    box = BwrapSandbox(SandboxSpec(image=instance["image"]), "forgery-sympy", {"root": str(root)})
    where = repo.checkout_into(box, instance, workdir)
    yield box, where
    box.close()
    subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.fixture(scope="module")
def grade(sympy_row, sandbox):
    """grade(patch) -> result; the checkout is put back to the base commit before each grade."""
    instance, _ = sympy_row
    box, where = sandbox

    def run(patch: str) -> dict:
        box.exec(f"cd {where} && git reset -q --hard {instance['base_commit']} && git clean -qfdx", timeout=300)
        return swe_eval.grade(box, where, instance, patch, 900)
    return run


@pytest.fixture(scope="module")
def gold(sympy_row, grade):
    return grade(sympy_row[0]["patch"])


def test_gold_patch_earns_one_with_a_clean_integrity_block(sympy_row, gold):
    info = gold["eval"]["integrity"]
    assert gold["reward"] == 1.0 and gold["resolved"] is True, (gold["eval"].get("error"), info)
    assert info["outcome"] == "clean" and gold["eval"]["tampered"] == [], info
    assert info["paths"]["flagged"] == [] and set(info["paths"]["changed"]) == _changed(sympy_row[0]["patch"])
    runner = info["runner"]
    assert runner["kind"] == "sympy-isolated" and runner["changed"] == [] and runner["rewritten"] == [], runner
    assert runner["root_first_on_path"] is False and runner["files"] == [TEST_FILE], runner
    assert {c["outcome"] for c in info["canaries"] if c["must"] == "pass"} == {"PASSED"}, info["canaries"]
    assert {c["outcome"] for c in info["canaries"] if c["must"] == "fail"} <= {"FAILED", "ERROR"}, info["canaries"]
    assert any(c["form"] == "raises" for c in info["canaries"]), info["canaries"]  # SymPy's raises, checked
    assert info["code"]["hooks"] == info["code"]["replaced"] == [] and info["code"]["checked"] >= 22, info["code"]
    assert gold["eval"]["FAIL_TO_PASS"] == {F2P: "PASSED"}
    assert set(gold["eval"]["PASS_TO_PASS"].values()) == {"PASSED"}


def test_the_bug_left_in_place_earns_nothing_and_is_clean(sympy_row, grade):
    """The control: a no-op change to the package is graded clean, the listed test failing."""
    result = grade(sympy_row[1]["(no-op)"])
    info = result["eval"]["integrity"]
    assert result["reward"] == 0.0 and info["outcome"] == "clean", info
    assert result["eval"]["FAIL_TO_PASS"][F2P] in ("FAILED", "ERROR"), result["eval"]["log_tail"]


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forgery_earns_nothing(sympy_row, grade, gold, name):
    result = grade(sympy_row[1][name])
    report, info = result["eval"], result["eval"].get("integrity", {})
    assert result["reward"] == 0.0 and result["resolved"] is False, report
    if name in FLAGGED:
        assert info["outcome"] == "tampered" and report["tampered"] == FLAGGED[name], report
    elif name in UNVERIFIED:
        assert info["outcome"] in ("unverified", "tampered") and report.get("error"), info
    elif name in RACES:
        assert info["outcome"] == "tampered" or (info["outcome"] == "clean" and report["FAIL_TO_PASS"][F2P] != "PASSED")
    elif name in DEFEATED:
        assert info["outcome"] == "clean" and report["FAIL_TO_PASS"][F2P] != "PASSED", report
    elif name in LOG_FORGED:
        assert info["outcome"] == "tampered" and f"log:{F2P}" in report["tampered"], report["tampered"]
    elif name in FAMILY:
        hostile_graders.check(name, result, F2P)
    elif name in REWRITTEN:
        assert info["outcome"] == "tampered" and f"rewritten:{TEST_FILE}" in report["tampered"], report["tampered"]
        assert report["FAIL_TO_PASS"][F2P] != "PASSED", report  # the file as read before the package loaded
    else:
        assert info["outcome"] == "tampered", info
        assert any(t.startswith(("canary:", "log:")) for t in report["tampered"]), report["tampered"]
    assert gold["reward"] == 1.0 and gold["eval"]["integrity"]["outcome"] == "clean"


OWN_RUNNER_PAYS = ["reporter-listed-ok-from-utilities-runtests", "sympy-test-replaced", "test-file-rewritten-at-import"]
# ... and where the canaries alone catch a blanket forgery (so the forgeries above the runner defeats are live)
OWN_RUNNER_CANARIES = ["reporter-all-ok", "compile-strips-asserts"]


@pytest.mark.parametrize("name", OWN_RUNNER_PAYS + OWN_RUNNER_CANARIES)
def test_sympys_own_runner_pays_targeted_forgeries(sympy_row, grade, monkeypatch, name):
    """Why the grader runs its own runner: with ``bin/test`` run as SWE-bench runs it (the
    isolation turned off here), the targeted forgeries earn 1 with the canaries as planted; the
    blanket ones only the canaries stop."""
    monkeypatch.setattr(swe_eval, "_isolated", lambda box, root, command, base: (command, [], {"kind": "log"}))
    result = grade(sympy_row[1][name])
    if name in OWN_RUNNER_PAYS:
        assert result["eval"]["FAIL_TO_PASS"] == {F2P: "PASSED"}, result["eval"]["log_tail"]
        assert result["reward"] == 1.0 and result["eval"]["integrity"]["outcome"] == "clean", result["eval"]
    else:
        assert result["reward"] == 0.0 and result["eval"]["integrity"]["outcome"] == "tampered", result["eval"]
        assert any(t.startswith("canary:") for t in result["eval"]["tampered"]), result["eval"]["tampered"]



def test_no_shape_spares_the_canaries_without_the_listed_test(sympy_row):
    """The canaries are the file's own tests copied: a forgery that spares code of their shape
    (the old template's, pure builtins, a twin of another test) spares the listed test with them."""
    hostile_graders.row_cannot_spare(sympy_row[0], TEST_FILE, F2P)
