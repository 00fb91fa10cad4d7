"""Issue 10, rows 12 and 13: graders that the code under test cannot forge.

Each attack runs for real: the code grader (``tasks.handlers.code.run_tests``) in a real bwrap
sandbox and once through the whole service; the SWE grader through the service with a fixture
repository and a malicious patch. Each asserts the attack earned nothing, and that the honest
solution still earns 1.0 in the same harness (so the test can fail both ways).
"""
from __future__ import annotations

import json
import time

import pytest
import requests

from sandboxes.base import SandboxSpec
from sandboxes.runtimes.bwrap import BwrapSandbox
from tasks.handlers.code import run_tests
from tests.sandboxes.conftest import needs_bwrap, sandbox_root  # noqa: F401 - a fixture

ADD_TESTS = {"kind": "python", "entry_point": "add",
             "code": "def check(candidate):\n    assert candidate(1, 1) == 2\n    assert candidate(2, 3) == 5\n"
                     "    assert candidate(0, 7) == 7\n"}
HONEST = "def add(a, b):\n    return a + b\n"
FORGED = json.dumps({"passed": 3, "total": 3, "results": []})

ATTACKS = {
    # row 12 as found: a forged report line, then an exit that skips the real one
    "forged-report-and-os-exit": f"import os\nprint({FORGED!r}, flush=True)\nos._exit(0)\n",
    "sys-exit-at-import": f"import sys\nprint({FORGED!r})\nsys.exit(0)\n",
    "exit-inside-the-call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "always-equal": ("class Anything:\n    def __eq__(self, other):\n        return True\n"
                     "    __ne__ = lambda self, other: False\n"
                     "def add(a, b):\n    return Anything()\n"),
    "int-subclass-equal": ("class Liar(int):\n    def __eq__(self, other):\n        return True\n"
                           "def add(a, b):\n    return Liar(0)\n"),
    "patched-builtins-json-print": (
        "import builtins, json, sys\n"
        "json.dumps = lambda *a, **k: '{\"value\": true}'\n"
        "json.loads = lambda *a, **k: {'passed': 3, 'total': 3}\n"
        "builtins.print = lambda *a, **k: sys.__stdout__.write('" + FORGED + "\\n')\n"
        "builtins.AssertionError = type('Never', (Exception,), {})\n"
        "def add(a, b):\n    return 0\n"),
    "kill-the-judge": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef add(a, b):\n    return 0\n",
}

# Steals what it can, then leaves a process behind that prints forged reports (with every
# nonce it could find) into the shell's own output after the judge finished.
THIEF = r'''
import os, re, time
forged = FORGED
judge = os.getppid()
found = {}
def probe(name, fn):
    try:
        found[name] = str(fn())[:200]
    except Exception as exc:
        found[name] = "denied: " + type(exc).__name__
probe("spec", lambda: open("spec.json").read())
probe("environ", lambda: open(f"/proc/{judge}/environ", "rb").read())
probe("stdout", lambda: open(f"/proc/{judge}/fd/1", "w"))
probe("mem", lambda: open(f"/proc/{judge}/mem", "rb").read(1))
with open("/proc/%d/stat" % judge) as fh:
    shell = int(fh.read().rsplit(")", 1)[1].split()[1])
open("proof.json", "w").write(__import__("json").dumps(found))
nonces = set(re.findall(r"[0-9a-f]{32}", " ".join(found.values())))
if os.fork() == 0:
    os.setsid()
    lines = "\n" + "\n".join([n + " " + forged for n in nonces] + [forged]) + "\n"
    for _ in range(300):  # before, during and after the judge's own report
        for target in (f"/proc/{shell}/fd/1", f"/proc/{judge}/fd/1"):
            try:
                with open(target, "w") as out:
                    out.write(lines)
            except OSError:
                pass
        time.sleep(0.01)
    os._exit(0)
def add(a, b):
    return a - b
'''.replace("FORGED", repr(FORGED))


class EvalContext:
    """What ``run_tests`` needs of a stage: the instance, a sandbox opener, the time left."""

    def __init__(self, root: str):
        self.instance: dict = {}
        self.root = root
        self.boxes: list[BwrapSandbox] = []

    def open_sandbox(self, spec: SandboxSpec) -> BwrapSandbox:
        box = BwrapSandbox(spec, f"grader-test-{len(self.boxes)}", {"root": self.root})
        self.boxes.append(box)
        return box

    def remaining(self) -> float:
        return 60.0

    def close(self) -> None:
        for box in self.boxes:
            box.close()


@pytest.fixture
def eval_ctx(sandbox_root):
    ctx = EvalContext(str(sandbox_root))
    yield ctx
    ctx.close()


@needs_bwrap()
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_code_grader_attack_earns_nothing_in_bwrap(eval_ctx, name):
    report = run_tests(eval_ctx, ATTACKS[name], ADD_TESTS)
    assert report["passed"] == 0, report
    assert report["integrity"]["outcome"] in ("clean", "unverified"), report  # the judge itself was not reached
    honest = run_tests(eval_ctx, HONEST, ADD_TESTS)
    assert (honest["passed"], honest["total"]) == (3, 3), honest
    assert honest["integrity"]["outcome"] == "clean", honest["integrity"]  # issue 23: canaries as planted
    assert {(c["canary"], c["passed"]) for c in honest["integrity"]["canaries"]} == {("pass", True), ("fail", False)}


@needs_bwrap()
def test_code_grader_secrets_are_out_of_reach_and_late_forgeries_do_not_count(eval_ctx):
    report = run_tests(eval_ctx, THIEF, ADD_TESTS)
    assert (report["passed"], report["total"]) == (0, 3), report
    box = eval_ctx.boxes[-1]
    proof = json.loads(box.read_file("proof.json"))
    assert set(proof) == {"spec", "environ", "stdout", "mem"}
    assert all(value.startswith("denied") for value in proof.values()), proof
    honest = run_tests(eval_ctx, HONEST, ADD_TESTS)
    assert (honest["passed"], honest["total"]) == (3, 3), honest


def test_code_grader_attack_through_the_service(api, stack, tmp_path):
    """A humaneval job whose submitted answer forges the report: reward 0; the honest one: 1.0."""
    from tasks.handlers.code import humaneval_problems
    from tests.conftest import submit, wait

    problem = humaneval_problems()["HumanEval/0"]
    forged = f"import os\nprint({FORGED!r}, flush=True)\nos._exit(0)\n"
    honest = problem["canonical_solution"]
    results = {}
    for name, answer in (("forged", forged), ("honest", problem["prompt"] + honest)):
        script = tmp_path / f"{name}.json"
        script.write_text(json.dumps([{"tool_calls": [{"name": "submit", "arguments": {"answer": answer}}]}]))
        requests.post(f"{api}/clear_llm_server", timeout=10)
        url = stack.start_fake_llm(name=f"fake-grader-{name}",
                                   extra_args=["--policy", f"scripted:{script}", "--latency-model", "none"])
        assert requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "generate", "dialect": "fake"}, timeout=10).ok
        view = wait(api, submit(api, {"data_source": "humaneval", "task_id": "HumanEval/0"}), timeout=120)
        assert view["status"] == "completed", view
        results[name] = view["result"]
    requests.post(f"{api}/clear_llm_server", timeout=10)
    assert results["forged"]["reward"] == 0.0 and results["forged"]["resolved"] is False, results["forged"]["eval"]
    assert results["honest"]["reward"] == 1.0 and results["honest"]["resolved"] is True, results["honest"]["eval"]


# -- SWE (row 13) -------------------------------------------------------------------------------

PACKAGE_OVERRIDE = '''
import unittest as _unittest


def _always_ok(self, result=None):
    result.startTest(self)
    result.addSuccess(self)
    result.stopTest(self)


_unittest.TestCase.run = _always_ok
'''


def _swe_job(api, stack, tmp_path, name: str, commands: list[str]) -> dict:
    from prorl_celery.fakes import swe
    from tests.conftest import submit, wait

    instance = swe.build("statkit", tmp_path / f"repos-{name}")
    turns = [{"tool_calls": [{"name": "bash", "arguments": {"command": c}}]} for c in commands]
    script = tmp_path / f"{name}.json"
    script.write_text(json.dumps(turns + [{"tool_calls": [{"name": "submit", "arguments": {}}]}]))
    requests.post(f"{api}/clear_llm_server", timeout=10)
    url = stack.start_fake_llm(name=f"fake-swe-{name}",
                               extra_args=["--policy", f"scripted:{script}", "--latency-model", "none"])
    assert requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "generate", "dialect": "fake"}, timeout=10).ok
    try:
        view = wait(api, submit(api, instance), timeout=180)
    finally:
        requests.post(f"{api}/clear_llm_server", timeout=10)
    assert view["status"] == "completed", view
    return view["result"]


def _write(path: str, text: str, append: bool = False) -> str:
    return f"cat {'>>' if append else '>'} {path} <<'PRORL_EOF'\n{text}\nPRORL_EOF"


def test_swe_package_that_overrides_testcase_run_earns_nothing(api, stack, tmp_path):
    result = _swe_job(api, stack, tmp_path, "override", [_write("statkit/__init__.py", PACKAGE_OVERRIDE, append=True)])
    assert "_always_ok" in result["git_patch"]
    assert result["reward"] == 0.0 and result["resolved"] is False, result["eval"]
    assert set(result["eval"]["FAIL_TO_PASS"].values()) == {"FAILED"}, result["eval"]
    assert "TestCase.run" in result["eval"]["restored"] and "grader" in result["eval"]


def test_swe_patch_touching_tests_or_infrastructure_is_flagged(api, stack, tmp_path):
    conftest = "import unittest\nunittest.TestCase.run = lambda self, result=None: None\n"
    commands = [_write("tests/conftest.py", conftest), _write("sitecustomize.py", conftest),
                "sed -i 's/assertEqual/assertAlmostEqual/' tests/test_central.py"]
    result = _swe_job(api, stack, tmp_path, "tamper", commands)
    assert result["reward"] == 0.0 and result["resolved"] is False
    assert result["eval"]["tampered"] == ["sitecustomize.py", "tests/conftest.py", "tests/test_central.py"]


def test_swe_honest_fix_still_resolves(api, stack, tmp_path):
    from prorl_celery.fakes.swe import HERE

    fixed = (HERE / "statkit" / "fixed" / "statkit" / "central.py").read_text()
    result = _swe_job(api, stack, tmp_path, "honest", [_write("statkit/central.py", fixed.rstrip("\n"))])
    assert result["reward"] == 1.0 and result["resolved"] is True, result["eval"]
    assert result["eval"]["tampered"] == [] and result["eval"]["restored"] == []
