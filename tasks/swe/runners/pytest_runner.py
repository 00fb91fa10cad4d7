"""Runs pytest so that the repository cannot stand in for the runner or bring plugins (standard
library and the environment's pytest only; the SWE grader copies it into the sandbox).

    python3 pytest_runner.py NONCE_FILE ROOT PYTEST_ARGS...   (in the repository's root)

- Run as a script from outside the repository, so the repository's root is not the first entry
  of ``sys.path`` (``python -m pytest`` puts the working directory first: a ``pytest.py`` or
  ``_pytest/`` at the root would be the runner): it goes last, behind the standard library and
  the environment; this file's own directory is dropped.
- ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``, ``PYTEST_ADDOPTS`` and ``PYTEST_PLUGINS`` cleared; the
  ``pytest11`` plugins of distributions installed *outside* the repository (the environment the
  base tree was built with) are loaded by name with ``-p``; a ``*.dist-info`` in the tree is not.
- The grader passes the configuration it wrote (``-c``, ``--rootdir``) among the arguments;
  ``--maxfail=0`` goes last, so that a planted must-fail canary never ends the run early.
- Each test's outcome is recorded by a plugin of this file, printed last as one line
  ``<nonce> <json>`` on a copy of stdout taken before any of the repository is imported, then the
  process ends with ``os._exit`` (no ``atexit`` hook of the package runs after it). The grader
  cross-checks the log's outcomes with this report; the nonce file is deleted once read.

The code under test still runs in this process: it can rewrite reports (the grader's canaries
catch a blanket rewrite) or find this module's objects in memory; that it cannot be prevented here.
"""
from __future__ import annotations

import json
import os
import sys

_EXIT = os._exit  # the package may replace os._exit (to let its atexit hooks run)

_RANK = {"PASSED": 0, "SKIPPED": 1, "FAILED": 2, "ERROR": 2}


def _path_for(root: str) -> None:
    """This file's directory off ``sys.path``; the root last, behind the standard library and the
    environment (``python -m pytest`` would put it first; a repository that is not installed
    still imports its package from there)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") not in (here, os.path.abspath(root))]
    sys.path.append(os.path.abspath(root))


def _env_plugins(root: str) -> list[str]:
    """Entry-point names of the ``pytest11`` plugins installed outside ``root``."""
    import importlib.metadata as metadata

    names: list[str] = []
    prefix = os.path.realpath(root) + os.sep
    for dist in metadata.distributions():
        where = os.path.realpath(str(dist.locate_file(""))) + os.sep
        if where.startswith(prefix):
            continue
        for ep in dist.entry_points:
            if ep.group == "pytest11" and ep.name not in names:
                names.append(ep.name)
    return names


class Record:
    """Each test's outcome as this process's pytest reported it (SWE-bench's reading: an
    expected failure passes, an unexpected pass fails, an error in setup or teardown is ERROR)."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}

    def _set(self, nodeid: str, status: str) -> None:
        if _RANK[status] >= _RANK.get(self.outcomes.get(nodeid, ""), -1):
            self.outcomes[nodeid] = status

    def pytest_runtest_logreport(self, report) -> None:
        xfail = hasattr(report, "wasxfail")
        if report.when == "call":
            if xfail:
                self._set(report.nodeid, "PASSED" if report.skipped else "FAILED")
            else:
                self._set(report.nodeid, {"passed": "PASSED", "failed": "FAILED"}.get(report.outcome, "SKIPPED"))
        elif report.failed:
            self._set(report.nodeid, "ERROR")
        elif report.skipped:
            self._set(report.nodeid, "PASSED" if xfail else "SKIPPED")


def main() -> int:
    nonce_file, root, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    with open(nonce_file) as fh:
        nonce = fh.read().strip()
    os.unlink(nonce_file)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    _path_for(root)
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        os.environ.pop(name, None)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    plugins = _env_plugins(root)
    import pytest

    facts = {"pytest": getattr(pytest, "__version__", "?"), "pytest_file": getattr(pytest, "__file__", ""),
             "plugins": plugins, "root_first_on_path": bool(sys.path) and
             os.path.abspath(sys.path[0] or ".") == os.path.abspath(root)}
    record = Record()
    extra = [item for name in plugins for item in ("-p", name)]
    try:  # --maxfail=0 last: the grader's must-fail canary must not stop the run (-x, --maxfail)
        code = int(pytest.main(extra + args + ["--maxfail=0"], plugins=[record]))
    except BaseException as exc:  # noqa: BLE001 - whatever ended the run, the report says so
        facts["error"], code = repr(exc)[:500], 3
    for stream in (sys.stdout, sys.stderr):  # pytest's own summary first, then the report
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    out.write(f"\n{nonce} {json.dumps({'outcomes': record.outcomes, **facts})}\n")
    out.flush()
    return code


if __name__ == "__main__":
    _EXIT(main())
