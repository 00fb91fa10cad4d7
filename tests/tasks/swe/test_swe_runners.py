"""The SWE grader's test runners behind one protocol (tasks/swe/runners): the registry names the
known kinds when one is unknown, every registered family passes the conformance check and a broken
one is refused naming why, and the grader isolates a command's runs through the first family the
command runs, writing each file a run needs into the sandbox (a recording stand-in here)."""
from __future__ import annotations

import pytest

from prorl_celery.errors import UnknownPlugin
from tasks.handlers import get_handler, instance_check
from tasks.swe import grader, runners
from tasks.swe.handler import SweHandler
from tasks.swe.runners.base import RUNNERS_DIR, RunSite, ScriptRunner, check_runner
from tasks.swe.runners.pytest_isolation import PytestRunner

pytestmark = pytest.mark.unit


class Box:
    """What a runner writes into a sandbox, by path; a repository with no file at its base."""

    def __init__(self):
        self.files: dict[str, bytes] = {}

    def write_file(self, path: str, data: bytes) -> None:
        self.files[path] = data

    def read_file(self, path: str) -> bytes:
        raise FileNotFoundError(path)

    def exec(self, command: str, timeout: float) -> None:
        return None


def test_an_unknown_kind_lists_the_known_ones():
    with pytest.raises(UnknownPlugin) as caught:
        runners.get_runner("nose")
    assert "known: django-guarded, pytest-isolated, sympy-isolated" in str(caught.value)


def test_every_registered_runner_conforms_and_the_families_go_before_pytest():
    assert [runner.kind for runner in runners.in_order()] == ["django-guarded", "sympy-isolated", "pytest-isolated"]
    for kind, path in runners.RUNNERS.entries.items():
        assert runners.get_runner(kind).kind == kind
        check_runner(type(runners.get_runner(kind)))
    assert runners.known("log") is None and runners.known("unittest-guard") is None


class Rewrites(ScriptRunner):
    kind, note, name = "greedy", "rewrites everything", "greedy"
    script = RUNNERS_DIR / "pytest_runner.py"

    def rewrite(self, command, start):
        return start("python3", 0), 1


class NoScript(Rewrites):
    script = RUNNERS_DIR / "no_such_runner.py"
    errors_once = "yes"

    def rewrite(self, command, start):
        return command, 0


def test_a_runner_that_does_not_conform_is_refused_naming_why():
    with pytest.raises(UnknownPlugin, match=r"rewrite\('true'\) gave"):
        check_runner(Rewrites)
    with pytest.raises(UnknownPlugin) as caught:
        check_runner(NoScript)
    assert "errors_once is not a bool" in str(caught.value) and "no_such_runner.py" in str(caught.value)


def test_a_pytest_command_runs_the_grader_s_pytest_with_the_base_configuration():
    box = Box()
    command, nonces, block = grader._isolated(box, "/w/repo", "python -m pytest -rA tests/test_a.py", "abc")
    assert block == {"kind": "pytest-isolated", "config_from": None, "plugin_autoload": False}
    assert len(nonces) == 1 and command.startswith("python /w/.prorl-pytest-runner.py /w/.prorl-pytest-nonce-0 /w/repo")
    assert box.files["/w/.prorl-pytest-nonce-0"] == nonces[0].encode()
    assert box.files["/w/.prorl-pytest-runner.py"] == PytestRunner.script.read_bytes()
    config = next(path for path in box.files if path.endswith(".ini"))
    assert f"-c {config} --rootdir /w/repo" in command and box.files[config] == b"[pytest]\n"


@pytest.mark.parametrize("command,kind,name", [
    ("./tests/runtests.py --verbosity 2 utils_tests", "django-guarded", "django"),
    ("bin/test -C --verbose sympy/core/tests/test_calc.py", "sympy-isolated", "sympy"),
])
def test_a_family_s_command_runs_its_own_script(command, kind, name):
    box = Box()
    isolated, nonces, block = grader._isolated(box, "/w/repo", command, "abc")
    assert block == {"kind": kind} and len(nonces) == 1 and f"/w/.prorl-{name}-runner.py" in isolated
    assert box.files[f"/w/.prorl-{name}-runner.py"] == runners.get_runner(kind).script.read_bytes()


def test_a_command_that_runs_no_known_runner_writes_nothing():
    box = Box()
    assert grader._isolated(box, "/w/repo", "make check", "abc") == ("make check", [], {"kind": "log"})
    assert grader._isolated(box, "/w/repo", "pytest -rA", None) == ("pytest -rA", [], {"kind": "log"})
    assert box.files == {}
    site = RunSite(box, "/w/repo", lambda name: None)
    assert all(runner.isolate("make check", site) is None for runner in runners.in_order()) and not site.nonces


def test_the_handler_s_old_dotted_path_still_loads_it():
    for name in ("tasks.handlers.swe:SweHandler", "tasks.handlers.swe.SweHandler", "swebench"):
        assert type(get_handler(name)) is SweHandler
    assert instance_check("tasks.handlers.swe:SweHandler").__func__ is SweHandler.check_instance
