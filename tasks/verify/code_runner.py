"""Runs a candidate solution against its tests, inside the sandbox (standard library only).

    python3 code_runner.py SPEC.json

SPEC: ``{"solution": path, "tests": {"kind": "python", "code": str, "entry_point": str | null}
| {"kind": "io", "cases": [{"input": str, "output": str}, ...]}, "timeout": seconds per test}``.

Python test code is split into single tests: each ``assert`` of a ``check(candidate)`` function (the
HumanEval form) or of the module's top level, and each ``test_*`` function, so the reward can be
the fraction that pass. The last line printed is the JSON report.
"""
from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
import traceback


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _run(code: str, env: dict, timeout: float) -> tuple[bool, str]:
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        exec(compile(code, "<test>", "exec"), env)  # noqa: S102 - this is the sandboxed runner
        return True, ""
    except _Timeout:
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


def run_python(solution: str, spec: dict, timeout: float) -> list[dict]:
    env: dict = {"__name__": "__candidate__"}
    ok, error = _run(solution, env, timeout)
    setup, tests = _split(spec["code"], spec.get("entry_point"))
    if not tests:
        return [{"name": "module", "passed": False, "error": "no tests found"}]
    if not ok:
        return [{"name": name, "passed": False, "error": f"solution failed to load: {error}"} for name, _ in tests]
    ok, error = _run("\n".join(setup), env, timeout)
    results = []
    for name, code in tests:
        passed, why = _run(code, dict(env), timeout) if ok else (False, f"test setup failed: {error}")
        results.append({"name": name, "passed": passed, "error": why})
    return results


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


def main() -> None:
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    with open(spec["solution"]) as fh:
        solution = fh.read()
    tests, timeout = spec["tests"], float(spec.get("timeout", 6))
    if tests["kind"] == "io":
        results = run_io(spec["solution"], tests["cases"], timeout)
    else:
        results = run_python(solution, tests, timeout)
    passed = sum(r["passed"] for r in results)
    print(json.dumps({"passed": passed, "total": len(results), "results": results}))


if __name__ == "__main__":
    main()
