"""``scripts/test.sh``, the README's test command, run with stand-ins for pip, pytest and the
install scripts: the fast tier is its first stage and stops the run at its first failure, the
second stage runs the rest of the default selection without the unit tests, and a caller's own
marker choice is one run of exactly that.

The stand-ins are a ``python3`` that records each ``-m pytest`` argument list and answers with the
exit codes the test queues (any other ``python3`` use is the real interpreter), and a ``bash``
that only records the install script it was asked to run; the script under test is the real one,
run by the real bash.
"""
from __future__ import annotations

import configparser
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

PYTHON_STUB = """#!{python}
import json, os, sys
args = sys.argv[1:]
if args[:2] == ["-m", "pytest"]:
    with open(os.environ["STUB_LOG"], "a") as log:
        log.write(json.dumps(args[2:]) + "\\n")
    codes = os.environ["STUB_CODES"].split()
    done = sum(1 for _ in open(os.environ["STUB_LOG"]))
    sys.exit(int(codes[done - 1]) if done <= len(codes) else 0)
if args[:2] == ["-m", "pip"]:
    sys.exit(0)
os.execv({python!r}, [{python!r}, *args])
"""


def _default_markers() -> str:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    addopts = shlex.split(cfg["tool:pytest"]["addopts"])
    return addopts[addopts.index("-m") + 1]


def _run(tmp_path: Path, *args: str, codes: str = "") -> tuple[int, list[list[str]]]:
    """Runs scripts/test.sh with the stand-ins; returns its exit code and each pytest argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    python = bin_dir / "python3"
    python.write_text(PYTHON_STUB.format(python=sys.executable))
    (bin_dir / "bash").write_text("#!/bin/sh\nexit 0\n")  # the install scripts
    for stub in (python, bin_dir / "bash"):
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "pytest.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "STUB_LOG": str(log), "STUB_CODES": codes}
    done = subprocess.run([shutil.which("bash"), str(ROOT / "scripts" / "test.sh"), *args],
                          env=env, capture_output=True, text=True, timeout=60)
    runs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done.returncode, runs


def test_the_fast_tier_runs_first_then_the_rest_of_the_default_suite(tmp_path):
    code, runs = _run(tmp_path)
    assert code == 0
    assert runs == [["-m", "unit", "-x"], ["-m", f"not unit and ({_default_markers()})"]]


def test_a_failing_fast_tier_stops_the_run(tmp_path):
    code, runs = _run(tmp_path, codes="1")
    assert code == 1
    assert runs == [["-m", "unit", "-x"]]


def test_paths_go_to_both_stages_and_a_stage_with_nothing_to_run_is_not_a_failure(tmp_path):
    code, runs = _run(tmp_path, "tests/llm", "-q", codes="5 0")
    assert code == 0
    assert [run[-2:] for run in runs] == [["tests/llm", "-q"]] * 2
    code, runs = _run(tmp_path, "tests/llm", codes="0 5")  # only unit tests there, and they passed
    assert code == 0 and len(runs) == 2
    code, _ = _run(tmp_path, "tests/llm", codes="0 1")
    assert code == 1


def test_a_chosen_marker_is_one_run_of_exactly_that(tmp_path):
    for args in (["-m", "slow"], ["-m", "unit"], ["-m", "slow or not slow", "tests/security/test_reward_forgery.py"]):
        code, runs = _run(tmp_path, *args, codes="3")
        assert (code, runs) == (3, [args])
