"""``swe`` (aliases swebench, swe-gym, r2e): SWE-bench instances.

Fields: ``instance_id``, ``repo``, ``base_commit``, ``problem_statement``, ``test_patch``,
``FAIL_TO_PASS``, ``PASS_TO_PASS`` (lists, or lists as JSON strings as the Hugging Face datasets
store them), optional ``version``, ``eval_script`` and ``log_parser`` (SWE-bench's, see
:mod:`tasks.swe.specs`), optional ``image`` (the sandbox image, a registered one), ``repo_source``
(an https URL, or a directory beneath ``PRORL_REPO_SOURCE_DIRS``; default
``https://github.com/<repo>``) and ``test_cmd``.

init puts the repository at ``base_commit`` in the sandbox and starts the shell in its root; the
patch is ``git diff`` at the end of run, read whole through a file (not the agent's cut view of
command output); one past ``swe_patch_max_mb`` is not graded (reward 0, ``filter``,
``eval.error.type`` ``patch_too_large``); eval starts a fresh sandbox at a clean ``base_commit``,
applies the model patch and the test patch, runs the tests and reads each listed test's outcome.
A model patch that touches tests or test infrastructure is ``eval.tampered`` and earns nothing;
the tests run reset to base + test patch (see :mod:`tasks.swe.grader`, also for the residual
risk: the code under test runs in the test process). ``resolved`` iff every FAIL_TO_PASS and PASS_TO_PASS test passes. The reward is the fraction of
FAIL_TO_PASS tests that pass, and 0 if any PASS_TO_PASS test broke (doing nothing earns nothing).
"""
from __future__ import annotations

import os
import shlex
from typing import Any

from sandboxes.base import SandboxSpec
from tasks.context import StageContext
from tasks.handlers.agentic import AgentTaskHandler
from tasks.handlers.instances import check_swe
from tasks.swe.repo import checkout_into
from tasks.swe import grader

REPO_DIR = "repo"
SYSTEM = ("You are a software engineer fixing an issue in a repository. The repository is checked out in "
          "the shell's current directory. Explore it with bash, edit files with str_replace_editor, run "
          "the tests, and call submit (with no answer) when the issue is fixed. Do not modify the tests.")


def _q(text: str) -> str:
    return shlex.quote(text)


def _patch_cap() -> int:
    from config.settings import get_settings

    return get_settings().swe_patch_max_mb * 1024 * 1024


def read_patch(box, repo_dir: str, base: str, cap: int) -> tuple[str | None, int]:
    """(the patch of the tree at ``repo_dir`` against ``base``, its size in bytes), read whole
    through a file beside the repository, not the command output (which the agent's output
    limit cuts); (None, size) when it is larger than ``cap`` bytes, ("", 0) when git fails."""
    out = f"{os.path.dirname(repo_dir.rstrip('/'))}/.prorl-patch"
    diff = box.exec(f"rm -f {_q(out)}; cd {_q(repo_dir)} && git add -A >/dev/null 2>&1; "
                    f"git diff --cached {_q(base)} --binary > {_q(out)} 2>/dev/null", timeout=120)
    try:
        if diff.exit_code != 0:
            return "", 0
        size = box.stat(out).size
        if size > cap:
            return None, size
        return box.read_file(out).decode("utf-8", "replace"), size  # as the shell's output was
    except (FileNotFoundError, PermissionError):  # the agent moved or replaced what holds it
        return "", 0
    finally:
        box.exec(f"rm -f {_q(out)}", timeout=30)


def too_large(size: int, cap: int) -> dict[str, Any]:
    """The eval of a patch past the operator's limit: not graded, so the trainer drops it."""
    return {"reward": 0.0, "resolved": False, "filter": True, "eval": {
        "skipped": "patch too large", "patch_bytes": size, "limit_bytes": cap,
        "error": {"type": "patch_too_large", "message": f"the model patch is {size} bytes; "
                  f"this service grades patches up to {cap} bytes (swe_patch_max_mb)"}}}


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
        patch, size = read_patch(ctx.sandbox, ctx.state["repo_dir"], ctx.instance["base_commit"], _patch_cap())
        ctx.state["git_patch"] = patch
        if patch is None:
            ctx.state["git_patch"], ctx.state["git_patch_bytes"] = "", size

    def result_fields(self, state: dict[str, Any]) -> dict[str, Any]:
        return {**super().result_fields(state), "git_patch": state.get("git_patch", "")}

    def score(self, ctx: StageContext) -> dict[str, Any]:
        if ctx.state.get("git_patch_bytes") is not None:
            return too_large(ctx.state["git_patch_bytes"], _patch_cap())
        patch = ctx.state.get("git_patch", "")
        if not patch.strip():
            return {"reward": 0.0, "resolved": False, "eval": {"skipped": "empty patch"}}
        ctx.close_sandbox()
        box = ctx.open_sandbox(self.sandbox_spec(ctx.instance))  # a clean tree, not the agent's
        root = checkout_into(box, ctx.instance, REPO_DIR)
        return grader.grade(box, root, ctx.instance, patch, max(1.0, ctx.remaining() - 5))

