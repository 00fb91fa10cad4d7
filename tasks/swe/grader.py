"""The SWE grader: model patch, allow-list, tests reset to base + test patch, canaries, an isolated run.

1. The model patch is applied to a clean checkout; the paths it really changed are read from git.
2. Each changed path is judged by the allow-list of :mod:`tasks.swe.integrity.tamper` (the package's own
   source, docs, packaging metadata): anything else is ``integrity.paths.flagged`` and
   ``eval.tampered``: no reward, the tests are not run.
3. Every file of the test patch and every test-infrastructure file of the base commit is reset to
   the base commit, and the test patch applied (so nothing but the package differs from the
   reference the tests were written against).
4. Canaries (:mod:`tasks.swe.integrity.canaries`) are planted in the test patch's files.
5. A ``python -m unittest`` command runs under :mod:`tasks.swe.runners.unittest_guard`, whose
   nonce-framed report (cross-checked with its exit status) is the verdict; each pytest run of
   another command is replaced by :mod:`tasks.swe.runners.pytest_runner` with the base commit's
   configuration (:mod:`tasks.swe.runners.pytest_isolation`), and the log's passes are checked against
   that runner's own report; Django's ``tests/runtests.py`` runs under
   :mod:`tasks.swe.runners.django_runner` (:mod:`tasks.swe.runners.django_isolation`), the log's passes
   checked against its record; SymPy's ``bin/test`` is replaced by :mod:`tasks.swe.runners.sympy_runner`
   (:mod:`tasks.swe.runners.sympy_isolation`), which runs the test functions itself from sources read
   before the package loads, the log's passes checked against its record; other runners are read
   from their log.
   Every runner reads the test files before the package loads and runs a watch
   (:mod:`tasks.swe.runners.run_watch`, copied beside it): each test's function is checked against the
   code compiled from those sources just before it is called, and a profile or trace hook, a
   replaced ``__code__`` or the runner's machinery patched is reported (``integrity.code``,
   ``runner.changed``): the run is ``unverified``.
6. :mod:`tasks.swe.integrity` sums it up in ``eval.integrity``; only a ``clean`` run earns reward.

Residual risk: the code under test runs in the test process. What a test calls of the package (a
decorator, a helper, the objects it compares) is the package's to make lie; canaries, copies of
the file's own listed tests, catch such a forgery when it turns failures into passes for the
copies as for the originals. A forgery that finds the runner's or the watch's objects in memory
and silences them is not caught, nor one that guesses which of two twins is the copy (its odds are
those of the guess, against the canaries alone: the code check does not guess).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shlex
from pathlib import Path
from typing import Any

from tasks.swe import integrity, runners, specs as swe_specs, test_log
from tasks.swe.integrity import canaries, tamper
from tasks.swe.runners.base import RunSite

GRADER_VERSION = "1"  # bump when grading changes: it lifts the hack audit's quarantine (tasks/audit)
GUARD = Path(__file__).resolve().parent / "runners" / "unittest_guard.py"
RUN_WATCH = Path(__file__).resolve().parent / "runners" / "run_watch.py"  # copied beside each runner, which loads it
WATCH_KEYS = ("hooks", "replaced", "checked", "unchecked")  # a runner report's watch, in integrity.code
_UNITTEST = re.compile(r"^\s*python3?\s+-m\s+unittest\b(.*)$", re.S)
NOTE_GUARDED = ("unittest outcomes from a guard that restores the unittest machinery after the package "
                "is imported; the code under test still runs in the test process")
NOTE_LOG = "outcomes parsed from the test log, which the code under test can print to"


def _q(text: str) -> str:
    return shlex.quote(text)


def apply_patch(box, root: str, patch: str) -> bool:
    if not patch.strip():
        return True
    box.write_file(f"{root}/.prorl.patch", patch.encode())
    out = box.exec(f"cd {_q(root)} && (git apply --whitespace=nowarn .prorl.patch || "
                   "patch --batch --fuzz=5 -p1 -i .prorl.patch) && rm -f .prorl.patch", timeout=120)
    return out.exit_code == 0


def _lines(box, root: str, command: str) -> list[str]:
    """The NUL-separated names ``command`` prints (read whole, see :func:`_whole`)."""
    return [name for name in _whole(box, root, command).split("\0") if name.strip()]


def changed_paths(box, root: str, base: str) -> set[str]:
    return set(_changes(box, root, base)[0])


def _changes(box, root: str, base: str) -> tuple[set[str], set[str]]:
    """(paths the work tree changed since ``base``, those it made symlinks or submodules)."""
    fields = _whole(box, root, f"cd {_q(root)} && git add -A >/dev/null 2>&1; "
                               f"git diff --cached --no-renames --raw -z {_q(base)}").split("\0")
    paths, links = set(), set()
    for head, path in zip(fields[0::2], fields[1::2]):
        modes = head.lstrip(":").split()
        if path.strip() and len(modes) >= 2:
            paths.add(path)
            if modes[1] in tamper.LINK_MODES:
                links.add(path)
    return paths, links


def base_paths(box, root: str, base: str) -> set[str]:
    return set(_lines(box, root, f"cd {_q(root)} && git ls-tree -r -z --name-only {_q(base)}"))


def _whole(box, root: str, command: str) -> str:
    """What ``command`` prints, whole: through a file beside the repository, not the command
    output (cut in the middle past the output limit: a large repository's listing, a long file)."""
    out = f"{os.path.dirname(root.rstrip('/'))}/.prorl-output"
    box.exec(f"{command} > {_q(out)} 2>/dev/null", timeout=120)
    try:
        return box.read_file(out).decode("utf-8", "surrogateescape")
    except (FileNotFoundError, PermissionError):
        return ""
    finally:
        box.exec(f"rm -f {_q(out)}", timeout=30)


def _sections_changed(box, root: str, base: str, paths: set[str]) -> set[str]:
    changed = set()
    for path in (p for p in paths if tamper.needs_sections(p)):
        old = _whole(box, root, f"cd {_q(root)} && git show {_q(base)}:{_q(path)}")
        new = _whole(box, root, f"cd {_q(root)} && cat -- {_q(path)}")
        if tamper.test_sections(path, old) != tamper.test_sections(path, new):
            changed.add(path)
    return changed


def judge_paths(box, root: str, base: str, test_patch: str, in_base: set[str],
                command: str = "") -> dict[str, list[str]]:
    """The paths the model patch changed, those outside what it may change
    (:func:`tasks.swe.integrity.tamper.flagged`), and the allowed ones outside the package's source."""
    changed, links = _changes(box, root, base)
    flagged = tamper.flagged(changed, tamper.patch_paths(test_patch), in_base,
                             _sections_changed(box, root, base, changed), links, command)
    outside = [p for p in tamper.reported(changed, in_base) if p not in flagged]
    return {"changed": sorted(changed), "flagged": flagged, "outside": outside}


def find_tampering(box, root: str, base: str, test_patch: str) -> list[str]:
    return judge_paths(box, root, base, test_patch, base_paths(box, root, base))["flagged"]


def reset_tests(box, root: str, base: str, test_patch: str, in_base: set[str] | None = None) -> None:
    """Test-patch files and test infrastructure back to the base commit (new ones removed)."""
    in_base = base_paths(box, root, base) if in_base is None else in_base
    targets = tamper.patch_paths(test_patch) | {p for p in in_base if tamper.is_test_path(p)}
    restore = sorted(targets & in_base)
    remove = sorted(targets - in_base)
    for chunk in range(0, len(restore), 200):
        box.exec(f"cd {_q(root)} && git checkout -q {_q(base)} -- "
                 + " ".join(_q(p) for p in restore[chunk:chunk + 200]), timeout=120)
    if remove:
        box.exec(f"cd {_q(root)} && rm -f -- " + " ".join(_q(p) for p in remove), timeout=120)


def _log_cap() -> int:
    from config.settings import get_settings

    return get_settings().swe_test_log_max_mb * 1024 * 1024


def read_log(box, path: str, cap: int | None = None) -> tuple[str, int]:
    """(the test log at ``path`` in the sandbox, its size in bytes). Read whole, not through the
    agent's output limit; past ``cap`` bytes its head and tail halves are kept."""
    cap = _log_cap() if cap is None else cap
    half, p = cap // 2, _q(path)
    out = box.exec(f"n=$(wc -c < {p} 2>/dev/null || echo 0); if [ \"$n\" -gt {cap} ]; then "
                   f"{{ head -c {half} {p}; printf '\\n[prorl: %s bytes of the log cut here]\\n' "
                   f"$((n - {2 * half})); tail -c {half} {p}; }} > {p}.cut && mv -f {p}.cut {p}; fi; "
                   "echo \"$n\"", timeout=120)
    digits = re.findall(r"^\s*(\d+)\s*$", out.output, re.M)
    size = int(digits[-1]) if digits else 0
    try:
        data = box.read_file(path)
    except (FileNotFoundError, PermissionError):
        return "", size
    return data.decode("utf-8", "replace"), size


def _shell(root: str, spec: swe_specs.SweSpec, command: str, log: str) -> str:
    setup = "".join(f"{line}; " for line in spec.setup)
    return f"cd {_q(root)} && {{ {setup}{command}\n}} > {_q(log)} 2>&1"


def run_tests(box, root: str, spec: swe_specs.SweSpec | str, timeout: float,
              instance: dict[str, Any] | None = None, base: str | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """(outcomes by test name, facts about the run). The command's output goes to a log file
    beside the repository, read back whole (:func:`read_log`). With ``base`` (the base commit),
    pytest runs isolated (:mod:`tasks.swe.runners.pytest_isolation`) with the base's configuration."""
    if isinstance(spec, str):
        spec = swe_specs.SweSpec(test_cmd=spec, source="instance")
    home = os.path.dirname(root.rstrip("/"))
    log = f"{home}/.prorl-test.log"
    found = _UNITTEST.match(spec.test_cmd)
    if not found:
        return _run_from_log(box, root, spec, timeout, instance, base)
    nonce = secrets.token_hex(16)
    _copy_runner(box, home, "unittest-guard", GUARD)
    box.write_file(f"{home}/.prorl-nonce", nonce.encode())
    command = (f"python3 {_q(home + '/.prorl-unittest-guard.py')} {_q(home + '/.prorl-nonce')} "
               f"{found.group(1).strip()}")
    run = box.exec(_shell(root, spec, command, log), timeout=timeout)
    text, size = read_log(box, log)
    facts = {**_facts(run, text, size, spec), "grader": NOTE_GUARDED, "runner": {"kind": "unittest-guard"}}
    report = _guard_report(text, nonce)
    if report is None:
        return {}, {**facts, "error": "the unittest guard gave no report"}
    outcomes = report.get("outcomes") if isinstance(report.get("outcomes"), dict) else {}
    all_ok = all(v in (test_log.PASSED, test_log.SKIPPED) for v in outcomes.values())
    if (run.exit_code == 0) != all_ok:  # the report and the process disagree: believe neither
        return {}, {**facts, "error": f"guard report and exit status {run.exit_code} disagree"}
    facts.update({"restored": report.get("restored", []), **_watched([report])})
    if report.get("changed"):
        facts["error"] = f"the package changed the test machinery: {', '.join(report['changed'])[:500]}"
    return {str(k): str(v) for k, v in outcomes.items()}, facts


def _copy_runner(box, home: str, name: str, script: Path) -> None:
    """A runner script, and the watch it loads from beside it (:mod:`tasks.swe.runners.run_watch`)."""
    box.write_file(f"{home}/.prorl-{name}.py", script.read_bytes())
    box.write_file(f"{home}/.prorl-run-watch.py", RUN_WATCH.read_bytes())


def _watched(reports: list[dict]) -> dict[str, Any]:
    """What the runners' watch saw (``watch``) and, when it saw a hook or a test whose code is not
    the code compiled from the sources the runner read, the ``error`` that makes the run unverified."""
    hooks = [h for r in reports for h in r.get("hooks") or []]
    replaced = [t for r in reports for t in r.get("replaced") or []]
    watch = {"hooks": hooks, "replaced": replaced, "checked": sum(int(r.get("checked") or 0) for r in reports),
             "unchecked": [t for r in reports for t in r.get("unchecked") or []]}
    if replaced:
        return {"watch": watch, "error": f"tests whose code is not the code their source compiles to: "
                                         f"{', '.join(replaced)[:500]}"}
    if hooks:
        return {"watch": watch, "error": f"a profile or trace hook, or a replaced __code__: {'; '.join(hooks)[:500]}"}
    return {"watch": watch}


def _run_from_log(box, root: str, spec: swe_specs.SweSpec, timeout: float, instance: dict[str, Any] | None,
                  base: str | None) -> tuple[dict[str, str], dict[str, Any]]:
    """A command read from its log; its pytest runs isolated, their passes checked against the
    isolated runner's own reports."""
    log = f"{os.path.dirname(root.rstrip('/'))}/.prorl-test.log"
    command, nonces, runner = _isolated(box, root, spec.test_cmd, base)
    run = box.exec(_shell(root, spec, command, log), timeout=timeout)
    text, size = read_log(box, log)
    outcomes = swe_specs.parse(spec, text, instance)
    family = runners.known(runner["kind"])
    facts = {**_facts(run, text, size, spec), "grader": family.note if family else NOTE_LOG, "runner": runner}
    if not nonces:
        return outcomes, facts
    reports = [_guard_report(text, nonce) for nonce in nonces]
    if any(report is None for report in reports):
        return {}, {**facts, "error": f"the {runner['kind']} runner gave no report"}
    return _checked_by_reports(outcomes, facts, runner, reports, family)


def _checked_by_reports(outcomes: dict[str, str], facts: dict[str, Any], runner: dict[str, Any],
                        reports: list[dict], family: runners.TestRunner) -> tuple[dict[str, str], dict[str, Any]]:
    """The log's ``outcomes`` checked against the isolated runner's ``reports``; ``facts`` (whose
    ``runner`` block is ``runner``) completed with what the reports say."""
    runner.update({k: v for k, v in reports[0].items() if k not in ("outcomes", *WATCH_KEYS)})
    error = _record_error(runner["kind"], reports)
    if error is not None:
        facts["error"] = error
    facts.update({k: v for k, v in _watched(reports).items() if k not in facts})
    facts["rewritten"] = sorted({p for report in reports for p in report.get("rewritten") or []})
    merged = {str(k): str(v) for report in reports for k, v in (report.get("outcomes") or {}).items()}
    outcomes, facts["log_disagreements"] = integrity.cross_check(outcomes, merged, family.errors_once)
    return outcomes, facts


def _record_error(kind: str, reports: list[dict]) -> str | None:
    """Why the runner's record proves nothing, if it does not (None when it stands)."""
    changed = sorted({name for report in reports for name in report.get("changed") or []})
    ended = next((str(report["error"]) for report in reports if report.get("error")), None)
    if changed:  # the package replaced the machinery the record is kept by: the record proves nothing
        return f"the package changed the test machinery: {', '.join(changed)[:500]}"
    if ended:  # the run did not end as the runner ends it: what it recorded is not the whole run
        return f"the {kind} runner's run ended early: {ended[:500]}"
    return None


def _isolated(box, root: str, command: str, base: str | None) -> tuple[str, list[str], dict[str, Any]]:
    """(``command`` with its test runs isolated, their nonces, what the runner block says): the
    runs of the first family of :mod:`tasks.swe.runners` the command runs (Django's or SymPy's
    runner, else each pytest run)."""
    if base is None:
        return command, [], {"kind": "log"}
    site = RunSite(box, root, lambda name: _at_base(box, root, base, name))
    for runner in runners.in_order():
        found = runner.isolate(command, site)
        if found is not None:
            return found[0], site.nonces, found[1]
    return command, [], {"kind": "log"}


def _at_base(box, root: str, base: str, name: str) -> str | None:
    listed = _whole(box, root, f"cd {_q(root)} && git ls-tree --name-only {_q(base)} -- {_q(name)}")
    if not listed.strip():
        return None
    return _whole(box, root, f"cd {_q(root)} && git show {_q(base)}:{_q(name)}")


def _facts(run, text: str, size: int, spec: swe_specs.SweSpec) -> dict[str, Any]:
    return {"exit_code": run.exit_code, "timed_out": run.timed_out, "log_tail": text[-3000:],
            "log_bytes": size, "log_chars_read": len(text), "test_cmd": spec.test_cmd,
            "spec": spec.source, "parser": spec.parser}


def _guard_report(output: str, nonce: str) -> dict | None:
    for line in output.splitlines():
        if line.startswith(nonce + " "):
            try:
                report = json.loads(line[len(nonce) + 1:])
            except ValueError:
                return None
            return report if isinstance(report, dict) else None
    return None


def plant_canaries(box, root: str, test_patch: str, command: str,
                   listed: dict[str, list[str]] | None = None) -> list[canaries.Canary]:
    """Canaries in the Python test files the test patch touches (:mod:`tasks.swe.integrity.canaries`),
    copied from the instance's listed tests (``listed``: ``fail`` and ``pass`` names)."""
    files = {}
    for path in (p for p in swe_specs.test_files(test_patch) if canaries.is_test_module(p)):
        try:
            files[path] = box.read_file(f"{root.rstrip('/')}/{path}").decode("utf-8")
        except (FileNotFoundError, PermissionError, UnicodeDecodeError):
            continue
    return integrity.plant(files, command, lambda path, text: box.write_file(f"{root.rstrip('/')}/{path}", text.encode()),
                           listed)


def grade(box, root: str, instance: dict[str, Any], patch: str, timeout: float) -> dict[str, Any]:
    """The eval result of ``patch`` in a clean checkout at ``root`` of ``box``."""
    base, test_patch = instance["base_commit"], instance.get("test_patch", "")
    if not apply_patch(box, root, patch):
        return {"reward": 0.0, "resolved": False,
                "eval": {"applied": {"model_patch": False}, "error": "model patch does not apply"}}
    in_base, spec = base_paths(box, root, base), swe_specs.spec_for(instance)
    paths = judge_paths(box, root, base, test_patch, in_base, spec.test_cmd)
    if paths["flagged"]:
        info = integrity.block(paths, None, [], [], None)
        return {"reward": 0.0, "resolved": False, "eval": {
            "tampered": integrity.tampered_names(info), "applied": {"model_patch": True}, "integrity": info,
            "error": "the model patch changes paths outside the package's own source (tests, test "
                     "infrastructure, root files, dotfiles, metadata)"}}
    reset_tests(box, root, base, test_patch, in_base)
    applied = {"model_patch": True, "test_patch": apply_patch(box, root, test_patch)}
    listed = {"fail": test_log.test_list(instance.get("FAIL_TO_PASS"), "instance.FAIL_TO_PASS"),
              "pass": test_log.test_list(instance.get("PASS_TO_PASS"), "instance.PASS_TO_PASS")}
    planted = plant_canaries(box, root, test_patch, spec.test_cmd, listed) if applied["test_patch"] else []
    outcomes, facts = run_tests(box, root, spec, timeout, instance, base=base)
    planted = canaries.read(planted, outcomes)
    info = integrity.block(paths, facts.pop("runner", None), planted, facts.pop("log_disagreements", []),
                           facts.get("error"), facts.pop("rewritten", []), facts.pop("watch", None))
    report = test_log.report(outcomes, test_log.test_list(instance.get("FAIL_TO_PASS"), "instance.FAIL_TO_PASS"),
                             test_log.test_list(instance.get("PASS_TO_PASS"), "instance.PASS_TO_PASS"))
    f2p = report["FAIL_TO_PASS"]
    broke = any(v != test_log.PASSED for v in report["PASS_TO_PASS"].values())
    fixed = sum(v == test_log.PASSED for v in f2p.values()) / len(f2p) if f2p else 0.0
    trusted = info["outcome"] == "clean"
    report.update({"applied": applied, "tampered": integrity.tampered_names(info), **facts, "integrity": info})
    if info["outcome"] == "tampered":
        report["error"] = "the run's outcomes were forged (see integrity)"
    return {"reward": 0.0 if broke or not applied["test_patch"] or not trusted else fixed,
            "resolved": report["resolved"] and applied["test_patch"] and trusted, "eval": report}
