"""``swe`` (aliases swebench, swe-gym, r2e): SWE-bench instances.

Fields: ``instance_id``, ``repo``, ``base_commit``, ``problem_statement``, ``test_patch``,
``FAIL_TO_PASS``, ``PASS_TO_PASS`` (lists, or lists as JSON strings as the Hugging Face datasets
store them), optional ``version``, ``eval_script`` and ``log_parser`` (SWE-bench's, see
:mod:`tasks.verify.swe_specs`), optional ``image`` (the sandbox image, a registered one), ``repo_source``
(an https URL, or a directory beneath ``PRORL_REPO_SOURCE_DIRS``; default
``https://github.com/<repo>``) and ``test_cmd``.

init puts the repository at ``base_commit`` in the sandbox and starts the shell in its root; the
patch is ``git diff`` at the end of run; eval starts a fresh sandbox at a clean ``base_commit``,
applies the model patch and the test patch, runs the tests and reads each listed test's outcome.
A model patch that touches tests or test infrastructure is ``eval.tampered`` and earns nothing;
the tests run reset to base + test patch (see :mod:`tasks.verify.swe_eval`, also for the residual
risk: the code under test runs in the test process). ``resolved`` iff every FAIL_TO_PASS and PASS_TO_PASS test passes. The reward is the fraction of
FAIL_TO_PASS tests that pass, and 0 if any PASS_TO_PASS test broke (doing nothing earns nothing).
"""
from __future__ import annotations

import shlex
from typing import Any

from sandboxes.base import SandboxSpec
from tasks.context import StageContext
from tasks.handlers.agentic import AgentTaskHandler
from tasks.handlers.instances import check_swe
from tasks.handlers.repo import checkout_into
from tasks.verify import swe_eval

REPO_DIR = "repo"
SYSTEM = ("You are a software engineer fixing an issue in a repository. The repository is checked out in "
          "the shell's current directory. Explore it with bash, edit files with str_replace_editor, run "
          "the tests, and call submit (with no answer) when the issue is fixed. Do not modify the tests.")


def _q(text: str) -> str:
    return shlex.quote(text)


class SweHandler(AgentTaskHandler):
    name = "swe"
    default_sandbox = {"limits": {"memory_mb": 4096, "nproc": 256, "fsize_mb": 512}}

    def check_instance(self, instance: dict[str, Any]) -> None:
        """Also the instance's ``image``, ``repo_source``, test lists and ``base_commit``
        (:func:`tasks.handlers.instances.check_swe`, which the API calls without this class)."""
        check_swe(instance)

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
        return swe_eval.grade(box, root, ctx.instance, patch, max(1.0, ctx.remaining() - 5))

