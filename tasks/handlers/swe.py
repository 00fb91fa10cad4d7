"""``swe`` (aliases swebench, swe-gym, r2e): SWE-bench instances.

Fields: ``instance_id``, ``repo``, ``base_commit``, ``problem_statement``, ``test_patch``,
``FAIL_TO_PASS``, ``PASS_TO_PASS``, optional ``image`` (the sandbox image), ``repo_source`` (a
local path or git URL; default ``https://github.com/<repo>``) and ``test_cmd``.

init puts the repository at ``base_commit`` in the sandbox and starts the shell in its root; the
patch is ``git diff`` at the end of run; eval starts a fresh sandbox at a clean ``base_commit``,
applies the model patch and the test patch, runs the tests and reads each listed test's outcome.
``resolved`` iff every FAIL_TO_PASS and PASS_TO_PASS test passes. The reward is the fraction of
FAIL_TO_PASS tests that pass, and 0 if any PASS_TO_PASS test broke (doing nothing earns nothing).
"""
from __future__ import annotations

import shlex
from typing import Any

from sandboxes.base import SandboxSpec
from tasks.context import StageContext
from tasks.handlers.agentic import AgentTaskHandler
from tasks.handlers.repo import checkout_into
from tasks.verify import test_log

REPO_DIR = "repo"
SYSTEM = ("You are a software engineer fixing an issue in a repository. The repository is checked out in "
          "the shell's current directory. Explore it with bash, edit files with str_replace_editor, run "
          "the tests, and call submit (with no answer) when the issue is fixed. Do not modify the tests.")


def _q(text: str) -> str:
    return shlex.quote(text)


class SweHandler(AgentTaskHandler):
    name = "swe"
    default_sandbox = {"limits": {"memory_mb": 4096, "nproc": 256, "fsize_mb": 512}}

    def sandbox_spec(self, instance: dict[str, Any]) -> SandboxSpec:
        spec = super().sandbox_spec(instance)
        return spec.model_copy(update={"image": spec.image or instance.get("image")})

    def prepare(self, ctx: StageContext) -> None:
        root = checkout_into(ctx.sandbox, ctx.instance, REPO_DIR)
        ctx.sandbox.exec(f"cd {_q(root)}")
        ctx.state["repo_dir"] = root

    def prompt(self, ctx: StageContext) -> list[dict[str, Any]]:
        text = (f"Repository: {ctx.instance.get('repo', '')} at {ctx.state.get('repo_dir', REPO_DIR)}\n\n"
                f"Issue:\n{ctx.instance['problem_statement']}")
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]

    def after_run(self, ctx: StageContext, outcome) -> None:
        root = _q(ctx.state["repo_dir"])
        diff = ctx.sandbox.exec(f"cd {root} && git add -A >/dev/null 2>&1; git diff --cached "
                                f"{_q(ctx.instance['base_commit'])} --binary", timeout=120)
        ctx.state["git_patch"] = diff.output if diff.exit_code == 0 else ""

    def result_fields(self, state: dict[str, Any]) -> dict[str, Any]:
        return {**super().result_fields(state), "git_patch": state.get("git_patch", "")}

    def score(self, ctx: StageContext) -> dict[str, Any]:
        patch = ctx.state.get("git_patch", "")
        if not patch.strip():
            return {"reward": 0.0, "resolved": False, "eval": {"skipped": "empty patch"}}
        ctx.close_sandbox()
        box = ctx.open_sandbox(self.sandbox_spec(ctx.instance))  # a clean tree, not the agent's
        root = checkout_into(box, ctx.instance, REPO_DIR)
        applied = {name: _apply(box, root, text) for name, text in
                   (("model_patch", patch), ("test_patch", ctx.instance.get("test_patch", "")))}
        if not applied["model_patch"]:
            return {"reward": 0.0, "resolved": False, "eval": {"applied": applied, "error": "model patch does not apply"}}
        cmd = ctx.instance.get("test_cmd") or "python3 -m pytest -rA -p no:cacheprovider"
        run = box.exec(f"cd {_q(root)} && {cmd}", timeout=max(1.0, ctx.remaining() - 5))
        outcomes = test_log.parse(run.output)
        report = test_log.report(outcomes, list(ctx.instance.get("FAIL_TO_PASS", [])),
                                 list(ctx.instance.get("PASS_TO_PASS", [])))
        f2p = report["FAIL_TO_PASS"]
        broke = any(v != test_log.PASSED for v in report["PASS_TO_PASS"].values())
        fixed = sum(v == test_log.PASSED for v in f2p.values()) / len(f2p) if f2p else 0.0
        report.update({"applied": applied, "exit_code": run.exit_code, "timed_out": run.timed_out,
                       "log_tail": run.output[-3000:]})
        return {"reward": 0.0 if broke else fixed, "resolved": report["resolved"], "eval": report}


def _apply(box, root: str, patch: str) -> bool:
    if not patch.strip():
        return True
    box.write_file(f"{root}/.prorl.patch", patch.encode())
    out = box.exec(f"cd {_q(root)} && (git apply --whitespace=nowarn .prorl.patch || "
                   "patch --batch --fuzz=5 -p1 -i .prorl.patch) && rm -f .prorl.patch", timeout=120)
    return out.exit_code == 0
