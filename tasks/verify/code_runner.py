"""Runs a candidate solution against its tests, inside the sandbox (standard library only).

    python3 code_runner.py SPEC.json

SPEC: ``{"solution": path, "tests": {"kind": "python", "code": str, "entry_point": str | null}
| {"kind": "io", "cases": [{"input": str, "output": str}, ...]}, "timeout": seconds per test,
"nonce": str?}``.

Why the solution cannot forge the verdict: the solution's code never runs in this process.
- ``python`` tests: this process (the judge) runs the TEST code; the solution is loaded into a
  child process, and every name the solution defines appears here as a proxy whose calls,
  attribute reads and iteration are requests to the child over a pair of pipes. Replies carry
  plain data only (None, bool, int, float, str, bytes, list, tuple, set, dict), decoded here into
  the built-in types, so every ``==`` and ``assert`` is evaluated here on real built-ins: an
  object that "equals everything", a patched ``json``/``print``/builtins, ``sys.exit`` or
  ``os._exit`` in the child, or a forged report printed to stdout change nothing (the child's
  stdout and stderr are ``/dev/null``; an exit is a failed test). An object the solution returns
  that is not plain data stays in the child behind a handle, which equals nothing but itself.
- ``io`` tests: the solution is a child with its own stdin/stdout; its output is compared here.
- The report: with ``nonce`` in the spec, this process first reads the spec and DELETES it (so the
  solution cannot read the expected outputs or the nonce), makes itself non-dumpable (its memory
  and fds are out of reach of same-uid processes without CAP_SYS_PTRACE, which the sandbox drops),
  and prints ``<nonce> <json>``: the host accepts only that line. A process the solution leaves
  behind can print to the shell's output, but not the nonce; killing this process yields no
  report, which the host scores 0.
Test code is split into single tests: each ``assert`` of a ``check(candidate)`` function (the
HumanEval form) or of the module's top level, and each ``test_*`` function, so the reward can be
the fraction that pass.
"""
from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
import traceback

from code_proxy import Remote, _Timeout  # noqa: E402  (copied beside this file)


def _alarm(signum, frame):
    raise _Timeout()


def _judge(code: str, env: dict, remote: Remote, timeout: float) -> tuple[bool, str]:
    """Run trusted test ``code`` here; the solution's names in ``env`` are proxies."""
    remote.deadline = time.monotonic() + timeout
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        exec(compile(code, "<test>", "exec"), env)  # noqa: S102 - the test code is trusted
        return True, ""
    except _Timeout:
        remote.kill()
        return False, f"timed out after {timeout}s"
    except BaseException as exc:  # noqa: BLE001 - a failing test is data
        return False, "".join(traceback.format_exception_only(type(exc), exc)).strip()[-500:]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _split(code: str, entry_point: str | None) -> tuple[list[str], list[tuple[str, str]]]:
    """(setup statements, [(name, test statement)]) from Python test code."""
    tree = ast.parse(code)
    setup, tests = [], []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            args = [a.arg for a in node.args.args]
            bind = f"{args[0]} = {entry_point}\n" if args and entry_point else ""
            body_setup = [bind] if bind else []
            found = len(tests)
            for stmt in node.body:
                if isinstance(stmt, ast.Assert):
                    tests.append((f"check:{stmt.lineno}", "".join(body_setup) + ast.unparse(stmt)))
                else:
                    body_setup.append(ast.unparse(stmt) + "\n")
            if len(tests) == found:  # asserts only inside loops: the whole check is one test
                setup.append(ast.unparse(node))
                tests.append(("check", f"check({entry_point})"))
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            setup.append(ast.unparse(node))
            tests.append((node.name, f"{node.name}()"))
        elif isinstance(node, ast.Assert):
            tests.append((f"line:{node.lineno}", ast.unparse(node)))
        else:
            setup.append(ast.unparse(node))
    return setup, tests


def _load(remote: Remote, timeout: float) -> str:
    remote.deadline = time.monotonic() + timeout
    try:
        remote.start()
        return ""
    except BaseException as exc:  # noqa: BLE001
        remote.kill()
        return "timed out" if isinstance(exc, _Timeout) else str(exc)[-500:] or type(exc).__name__


def run_python(solution: str, spec: dict, timeout: float) -> list[dict]:
    setup, tests = _split(spec["code"], spec.get("entry_point"))
    if not tests:
        return [{"name": "module", "passed": False, "error": "no tests found"}]
    remote = Remote(solution)
    error = _load(remote, timeout)
    if error:
        return [{"name": name, "passed": False, "error": f"solution failed to load: {error}"} for name, _ in tests]
    env = {"__name__": "__test__", **remote.names}
    ok, error = _judge("\n".join(setup), env, remote, timeout)
    results = []
    for name, code in tests:
        if ok and not remote.alive() and (why := _load(remote, timeout)):
            results.append({"name": name, "passed": False, "error": f"solution failed to load: {why}"})
            continue
        passed, why = _judge(code, {**env, **remote.names}, remote, timeout) if ok else \
            (False, f"test setup failed: {error}")
        results.append({"name": name, "passed": passed, "error": why})
    results += _canaries(env, remote, timeout) if ok else []
    remote.kill()
    return results


def _canaries(env: dict, remote: Remote, timeout: float) -> list[dict]:
    """Two checks judged the way every test is, with the solution loaded: one must pass, one must
    fail. A judge that the solution could reach would show it here (the host reads them apart)."""
    return [{"name": f"canary:{must}", "canary": must,
             "passed": _judge(code, {**env, **remote.names}, remote, timeout)[0], "error": ""}
            for must, code in (("pass", "assert len('abc') == 3"), ("fail", "assert len('abc') == 4"))]


def run_io(solution_path: str, cases: list[dict], timeout: float) -> list[dict]:
    results = []
    for i, case in enumerate(cases):
        try:
            done = subprocess.run([sys.executable, solution_path], input=case.get("input", ""), text=True,
                                  capture_output=True, timeout=timeout)
            got, want = done.stdout.strip().split(), str(case.get("output", "")).strip().split()
            passed = done.returncode == 0 and got == want
            error = "" if passed else (done.stderr.strip()[-300:] or f"expected {want[:20]}, got {got[:20]}")
        except subprocess.TimeoutExpired:
            passed, error = False, f"timed out after {timeout}s"
        results.append({"name": f"case:{i}", "passed": passed, "error": error})
    return results


def _guard_self() -> None:
    """Non-dumpable: same-uid processes cannot read this one's memory, fds or environment."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass


def main() -> None:
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    nonce = spec.get("nonce")
    if nonce:  # the tests and the nonce leave the sandbox's filesystem before the solution runs
        os.unlink(sys.argv[1])
        _guard_self()
    with open(spec["solution"]) as fh:
        solution = fh.read()
    tests, timeout = spec["tests"], float(spec.get("timeout", 6))
    if tests["kind"] == "io":
        results = run_io(spec["solution"], tests["cases"], timeout)
    else:
        results = run_python(solution, tests, timeout)
    canaries = [r for r in results if r.get("canary")]
    results = [r for r in results if not r.get("canary")]
    passed = sum(r["passed"] for r in results)
    line = json.dumps({"passed": passed, "total": len(results), "results": results, "canaries": canaries})
    sys.stdout.write(f"\n{nonce} {line}\n" if nonce else line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
