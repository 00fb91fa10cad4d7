"""The verifier: a step graded in a fresh sandbox of the task's image, apart from the agent.

What the verifier sandbox holds: the image as built; the agent's changes beneath the task's
working directory (and the operator's ``harbor_carry_paths``), carried over as a tar the agent's
sandbox host built (no PATH shim, site-packages hook, ``/logs`` file or edited test the agent left
anywhere else comes along); ``/tests`` from the task folder (the task's own merged under the
step's); an empty ``/logs``; the offline verifier tools first on PATH (uv's installer served
locally: :mod:`sandboxes.runtimes.images.verifier_tools`). ``test.sh`` runs with the verifier's
env and timeout; then the reward files are watched from the host's side for a moment (a file
that changes then was written by something test.sh left running: ``tampered``, no reward), every
process in the sandbox is killed, and only then are ``/logs/verifier/reward.txt`` /
``reward.json`` read, from the host's side (``Sandbox.finish``). Before test.sh, anything the
agent left in the working directory that Python started there would import instead of the image's
own (a runner's module, a dependency, a standard module, a pytest11 plugin's metadata) is
``tampered``: test.sh is not run. What is left: a process the agent's code started that rewrites
the reward once, right after test.sh wrote it and before test.sh ended, is not told apart from
test.sh (the race is test.sh's last instructions); a module of a name the image lacks that a
runner tries to import all the same (pytest 8.4 in the Harbor set's images tries only ``_wmi`` and
``msvcrt``: standard names, so counted).

A ``test.sh`` that times out, or ends with no reward file or an unreadable one, is an
infrastructure fault (:class:`VerifierFailed`, the result's ``error.type``), never a reward of 0
the trainer would learn from.
"""
from __future__ import annotations

import base64
import json
import math
import shlex
from typing import Any

from prorl_celery.errors import VerifierFailed, VerifierNoReward, VerifierTimedOut
from tasks.harbor.task import Step

GRADER_VERSION = "3"  # bump when grading changes: it lifts the hack audit's quarantine (tasks/audit)
# 2: a test runner's module shadowed in the working directory is tampering (the audit of what we ship)
# 3: so is any module there shadowing the image's (a dependency, the standard library) and a
#    pytest11 plugin's metadata (the Harbor set's audit, session 16)
REWARD_TXT = "/logs/verifier/reward.txt"
REWARD_JSON = "/logs/verifier/reward.json"
READ_CAP = 1024 * 1024
OUTPUT_TAIL = 4000
SETTLE_S = 0.3  # the reward files watched after test.sh ends, before the kill: a rewriter shows


def parse_rewards(text_file: bytes | None, json_file: bytes | None) -> dict[str, float]:
    """The named rewards the verifier wrote: ``reward.json``'s numbers, else ``{"reward": x}``
    of ``reward.txt``; :class:`VerifierFailed` when neither is there or one is malformed."""
    if json_file is not None and json_file.strip():
        try:
            body = json.loads(json_file)
        except ValueError as exc:
            raise VerifierFailed(f"reward.json is not JSON: {exc}") from None
        if not isinstance(body, dict) or not body:
            raise VerifierFailed("reward.json must be a JSON object of named numbers")
        rewards = {}
        for key, value in body.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise VerifierFailed(f"reward.json: {key!r} is not a finite number ({value!r})")
            rewards[str(key)] = float(value)
        return rewards
    if text_file is not None and text_file.strip():
        try:
            value = float(text_file.decode(errors="replace").strip())
        except ValueError:
            raise VerifierFailed(f"reward.txt is not a number: {text_file[:80]!r}") from None
        if not math.isfinite(value):
            raise VerifierFailed(f"reward.txt is not finite: {value}")
        return {"reward": value}
    raise VerifierFailed("the verifier wrote no reward (/logs/verifier/reward.txt or reward.json)")


def headline(rewards: dict[str, float]) -> float:
    """The one reward a trainer optimises: the one named ``reward``, else the mean of all."""
    if "reward" in rewards:
        return rewards["reward"]
    return sum(rewards.values()) / len(rewards) if rewards else 0.0


# What `python3 -m pytest` (or any `python3 -m` / `-c`) run in the working directory imports from it
# before the image's own (the directory is first on sys.path for every import, not only the
# runner's): the test runner's modules, its dependencies and the standard library, and a
# distribution's metadata there whose pytest11 entry point pytest loads as a plugin. Looked for by
# the image's python3 started from / (so nothing of the working directory's is imported); without
# a python3 in the image, only the runner's own module names (RUNNER_MODULES) are looked for. What
# the image itself has there is the task's, not the agent's: never counted.
RUNNER_MODULES = ("pytest.py", "pytest", "_pytest", "pluggy.py", "pluggy", "py.py", "unittest.py", "unittest")
SHADOWED = "shadowed "
HARMLESS = ("__main__", "test")  # never imported by a runner; `test` is a common name for an agent's own folder
SHADOW_SCAN = """
import importlib.machinery as m, json, os, pkgutil, sys
wd, own = os.path.realpath(sys.argv[1]), set(json.loads(sys.argv[2]))
names = set(sys.builtin_module_names) | set(getattr(sys, "stdlib_module_names", ()))
names |= {n.split(".")[0] for n in %r}
for entry in sys.path:
    if entry and os.path.realpath(entry) != wd:
        names.update(i.name for i in pkgutil.iter_modules([entry]))
names -= set(%r)
sfx = sorted(m.all_suffixes(), key=len, reverse=True)
def plugin(meta):
    try:
        return "[pytest11]" in open(os.path.join(meta, "entry_points.txt"), errors="replace").read()
    except OSError:
        return False
hits = []
for e in sorted(set(os.listdir(wd)) - own):
    p = os.path.join(wd, e)
    if e.endswith((".dist-info", ".egg-info")):
        hits += [e] if plugin(p) else []
    elif os.path.isdir(p):
        hits += [e] if e in names and any(os.path.isfile(os.path.join(p, "__init__" + s)) for s in sfx) else []
    else:
        hits += [e] if next((e[:-len(s)] for s in sfx if e.endswith(s)), None) in names else []
print(" ".join(hits))
""" % (RUNNER_MODULES, HARMLESS)


def shadow_check(workdir: str, own: list[str] | None = None) -> str:
    """A shell command printing the entries of ``workdir`` that shadow what the image's Python
    imports (``own``: the entries the image itself has there, never counted)."""
    scan = f"cd / && python3 -c {shlex.quote(SHADOW_SCAN)} {shlex.quote(workdir)} {shlex.quote(json.dumps(own or []))}"
    static = f"ls -d -- {' '.join(RUNNER_MODULES)} 2>/dev/null | tr '\\n' ' '"
    return f"if command -v python3 >/dev/null 2>&1; then ({scan}) || {static}; else {static}; fi"


def test_command(step: Step, workdir: str, shadows: bool = True, own: list[str] | None = None) -> str:
    """test.sh run as Harbor runs it, in the working directory, its output kept in /logs; unless
    something there shadows what Python imports (``shadowed <names>`` is said instead; ``own``:
    the image's own entries there; ``shadows`` False: not looked for, as in Harbor's shared
    verifier, which runs in the agent's own sandbox)."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in step.verifier_env.items())
    check = shadow_check(workdir, own) if shadows else "true"
    return (f"mkdir -p /logs/verifier /logs/artifacts && cd {shlex.quote(workdir)} && "
            f"s=$({check}); s=$(echo $s); if [ -n \"$s\" ]; then echo \"{SHADOWED}$s\"; else "
            f"{'env ' + env + ' ' if env else ''}bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1; "
            "echo \"exit $?\"; fi")


def _read_shared(box: Any, paths: list[str]) -> Any:
    """The files as the shared sandbox's own shell reads them (the operator trusts that mode)."""
    from sandboxes.protocol import FinishResponse

    files: dict[str, bytes | None] = {}
    for path in paths:
        out = box.exec(f"base64 -w0 {shlex.quote(path)} 2>/dev/null || echo MISSING", timeout=30)
        text = out.output.strip()
        files[path] = None if text.endswith("MISSING") else base64.b64decode(text or b"")
    return FinishResponse(files=files)


def grade(box: Any, step: Step, workdir: str, timeout: float, shared: bool = False,
          own: list[str] | None = None) -> dict[str, Any]:
    """Run the step's test.sh in ``box`` (its files in place), then kill everything in it and read
    what the verifier wrote. Returns ``{rewards, reward, test_exit, output, test_s}`` (``tampered``: a
    reward file written after test.sh had ended, by something it left running, or a module
    shadowed in the working directory, whose ``own`` entries are the image's: no reward); the
    sandbox is closed."""
    out = box.exec(test_command(step, workdir, shadows=not shared, own=own), timeout=timeout)
    paths = [REWARD_TXT, REWARD_JSON, "/logs/verifier/test-stdout.txt"]
    done = _read_shared(box, paths) if shared else box.finish(paths, READ_CAP, settle_s=SETTLE_S)
    files = done.files
    output = (files.get("/logs/verifier/test-stdout.txt") or b"")[-OUTPUT_TAIL:].decode(errors="replace")
    if out.timed_out:
        raise VerifierTimedOut(f"test.sh ran past the verifier's timeout ({timeout:.0f} s); its output's "
                               f"tail: {output[-1000:]}")
    exit_line = out.output.strip().splitlines()[-1:] or [""]
    test_exit = int(exit_line[0].split()[-1]) if exit_line[0].startswith("exit ") else None
    if exit_line[0].startswith(SHADOWED):
        return {"rewards": {"reward": 0.0}, "reward": 0.0, "test_exit": None, "output": output,
                "test_s": round(out.duration_s, 3),
                "tampered": f"modules in {workdir} shadowing the image's: {exit_line[0][len(SHADOWED):].strip()} "
                            "(python3 -m pytest there would import them); test.sh not run"}
    late = [p for p in done.rewritten if p in paths[:2]]
    if late:
        return {"rewards": {"reward": 0.0}, "reward": 0.0, "test_exit": test_exit, "output": output,
                "test_s": round(out.duration_s, 3),
                "tampered": f"{', '.join(late)} written after test.sh ended (by a process it left running)"}
    try:
        rewards = parse_rewards(files.get(REWARD_TXT), files.get(REWARD_JSON))
    except VerifierFailed as exc:
        raise VerifierNoReward(f"{exc} (test.sh exit {test_exit}); its output's tail: {output[-1000:]}") from None
    return {"rewards": rewards, "reward": headline(rewards), "test_exit": test_exit, "output": output,
            "test_s": round(out.duration_s, 3)}


def min_reward_failure(rewards: dict[str, float] | None, minimum: float | dict[str, float] | None) -> str | None:
    """Why a step's rewards stop the task (Harbor's ``min_reward``), or None: each threshold is
    for the named reward (a bare number: for ``reward``); a missing one fails."""
    if minimum is None:
        return None
    thresholds = {"reward": minimum} if isinstance(minimum, (int, float)) else minimum
    for key, threshold in thresholds.items():
        actual = (rewards or {}).get(key)
        if actual is None or actual < threshold:
            return f"{key}={actual} below min_reward {threshold}"
    return None


def roll_up(steps: list[dict[str, Any]], strategy: str) -> dict[str, float]:
    """The task's rewards from its steps' (Harbor's strategies): ``final``: the last step run's
    (an early stop makes the stopping step's the final); ``mean``: per name, the mean over the steps that were graded
    (a name a step did not write counts 0 for it)."""
    graded = [s["rewards"] for s in steps if s.get("rewards") is not None]
    if strategy == "final":
        return dict(steps[-1].get("rewards") or {}) if steps else {}
    names = {k for r in graded for k in r}
    return {k: sum(r.get(k, 0.0) for r in graded) / len(graded) for k in sorted(names)} if graded else {}
