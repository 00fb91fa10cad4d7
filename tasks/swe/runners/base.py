"""The ``TestRunner`` protocol: how one repository family's test runs are swapped for the grader's.

A family's own runner (pytest, Django's ``tests/runtests.py``, SymPy's ``bin/test``) is code the
model patch can reach; the grader finds each run of it in the instance's test command and puts a
runner of its own in its place, a script copied into the sandbox that reports a nonce-framed
record the log is then cross-checked with. Each family is one module of this package
(``<family>_isolation.py``, the command rewrite and its :class:`TestRunner`, beside
``<family>_runner.py``, the script), registered in :mod:`tasks.swe.runners`.
:func:`check_runner` is the conformance check each one passes when it is first loaded.
"""
from __future__ import annotations

import inspect
import os
import secrets
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from prorl_celery.errors import UnknownPlugin

RUNNERS_DIR = Path(__file__).resolve().parent  # where the scripts copied into the sandbox live
Start = Callable[[str, int], str]  # (python, index of the run) -> the command that runs the grader's script
Isolated = tuple[str, dict[str, Any]]  # (the command with the runs swapped, the runner block)


@dataclass
class RunSite:
    """Where a test command is about to run: the sandbox ``box``, the repository ``root``, and
    ``at_base`` (a repository file's text at the base commit, None if it has none). A runner
    writes its script and nonce files beside the repository; the nonces it drew are kept in
    ``nonces``, one per run, in the order of the runs."""

    box: Any
    root: str
    at_base: Callable[[str], str | None]
    nonces: list[str] = field(default_factory=list)

    @property
    def home(self) -> str:
        return os.path.dirname(self.root.rstrip("/"))

    def script_path(self, name: str) -> str:
        return f"{self.home}/.prorl-{name}-runner.py"

    def starter(self, name: str, extra: str = "") -> Start:
        """What replaces each run: the ``name`` script, with a fresh nonce (written to a file the
        script reads and deletes), the root, then ``extra``."""
        def start(python: str, index: int) -> str:
            self.nonces.append(secrets.token_hex(16))
            nonce_file = f"{self.home}/.prorl-{name}-nonce-{index}"
            self.box.write_file(nonce_file, self.nonces[-1].encode())
            return (f"{python} {shlex.quote(self.script_path(name))} {shlex.quote(nonce_file)} "
                    f"{shlex.quote(self.root)}{extra}")
        return start

    def install(self, name: str, script: Path) -> None:
        """The runner's script, and beside it the watch every runner loads from there
        (:mod:`tasks.swe.runners.run_watch`: each test's code checked, hooks noted)."""
        self.box.write_file(self.script_path(name), script.read_bytes())
        self.box.write_file(f"{self.home}/.prorl-run-watch.py", (RUNNERS_DIR / "run_watch.py").read_bytes())


class TestRunner(Protocol):
    """One repository family's runner. ``kind`` is what ``eval.integrity.runner.kind`` says of a
    run it isolated, ``note`` what ``eval.grader`` says of its outcomes; ``errors_once`` that it
    reports a test's error once (as unittest does), so an error where the log claims a pass is
    forged (pytest honestly reports a test whose teardown failed as passed and errored)."""

    __test__ = False  # not a pytest test class, whatever its name
    kind: str
    note: str
    errors_once: bool

    def isolate(self, command: str, site: RunSite) -> Isolated | None:
        """``command`` with each run of this family's runner replaced by the grader's (its script
        and any file it needs written through ``site``), and the runner block; None when the
        command runs none (nothing is written then)."""
        ...


class ScriptRunner:
    """A family whose runs :meth:`rewrite` finds, each replaced by ``script`` (a file of this
    package), copied into the sandbox as ``.prorl-<name>-runner.py``."""

    kind = ""
    note = ""
    errors_once = False
    name = ""
    script: Path = RUNNERS_DIR

    def rewrite(self, command: str, start: Start) -> tuple[str, int]:
        """(``command`` with each run replaced by ``start(python, index)``, how many)."""
        raise NotImplementedError

    def isolate(self, command: str, site: RunSite) -> Isolated | None:
        command, count = self.rewrite(command, site.starter(self.name))
        if not count:
            return None
        site.install(self.name, self.script)
        return command, {"kind": self.kind}


def _never(python: str, index: int) -> str:
    raise AssertionError(f"a command without the family's runner was rewritten (run {index} by {python})")


def _problems(cls: type) -> list[str]:
    problems = [f"{attr} is not a non-empty string" for attr in ("kind", "note")
                if not (isinstance(getattr(cls, attr, None), str) and getattr(cls, attr))]
    if not isinstance(getattr(cls, "errors_once", None), bool):
        problems.append("errors_once is not a bool")
    try:
        inspect.signature(getattr(cls, "isolate")).bind(None, "", None)
    except (AttributeError, TypeError) as exc:
        problems.append(f"isolate(command, site) cannot be called: {exc}")
    if issubclass(cls, ScriptRunner):
        if not cls.script.is_file() or cls.script.parent != RUNNERS_DIR:
            problems.append(f"its script {cls.script} is not a file of {RUNNERS_DIR}")
        if not cls.name.isidentifier():
            problems.append(f"name {cls.name!r} is not an identifier")
    return problems


def check_runner(cls: type) -> None:
    """Raise :class:`UnknownPlugin` listing everything that keeps ``cls`` from grading: its
    attributes, ``isolate``'s signature, a script runner's script, and that a command running no
    test runner (``true``) is left alone."""
    problems = _problems(cls)
    if not problems and issubclass(cls, ScriptRunner):
        try:
            left = cls().rewrite("true", _never)
        except Exception as exc:  # noqa: BLE001 - whatever it raises is the finding
            left = f"{type(exc).__name__}: {exc}"
        if left != ("true", 0):
            problems.append(f"rewrite('true') gave {left!r}, not ('true', 0)")
    if problems:
        raise UnknownPlugin(f"test runner {cls.__module__}:{cls.__qualname__} does not conform: "
                            + "; ".join(problems))
