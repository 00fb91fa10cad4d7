"""``lookup``: ``{"files": {name: text}, "target": name, "code": "48213", "prompt"?}`` — open the
file the task names and say the code it holds.

A two-turn task for learning checks on small models through a harness: the reward depends on
what a tool observation said, so the loss mask over observations, the ids across turns and the
gateway's segments all meet the optimizer (examples/lookup_agent.py is the harness: it asks the
model which file to open, shows it the file, and asks for the code). The files are written to the
workspace at init; the other files hold other codes, so opening the wrong one shows in the grade
(``eval.decoy``). Graded on the final answer (a harness's last message, the built-in agent's
``submit`` or last message): ``code`` must appear in it, not inside a longer number, and no decoy
file's code may (an answer listing every file's code earned 1 before ``GRADER_VERSION`` 2).
"""
from __future__ import annotations

import re
from typing import Any

from tasks.context import StageContext
from tasks.handlers.agentic import AgentTaskHandler, final_answer, mentions
from tasks.handlers.instances import check_lookup

GRADER_VERSION = "2"  # 2: a decoy file's code in the answer earns nothing


class LookupHandler(AgentTaskHandler):
    name = "lookup"
    default_sandbox = {"limits": {"memory_mb": 512, "cpu_s": 30, "nproc": 32}}

    def check_instance(self, instance: dict[str, Any]) -> None:
        check_lookup(instance)

    def prompt(self, ctx: StageContext) -> list[dict[str, Any]]:
        names = ", ".join(sorted(ctx.instance["files"]))
        ask = ctx.instance.get("prompt") or (
            f"This folder holds {len(ctx.instance['files'])} files: {names}. The code you need is in "
            f"{ctx.instance['target']}. Open that file and tell me the code.")
        return [{"role": "user", "content": ask}]

    def prepare(self, ctx: StageContext) -> None:
        for name, text in ctx.instance["files"].items():
            ctx.sandbox.write_file(name, text.encode())

    def score(self, ctx: StageContext) -> dict[str, Any]:
        submitted, text = final_answer(ctx.state)
        given = (submitted if submitted is not None else text) or ""
        code, target = str(ctx.instance["code"]), ctx.instance["target"]
        decoys = [name for name, body in ctx.instance["files"].items()
                  if name != target and any(mentions(given, w) for w in re.findall(r"\d{3,}", body))]
        correct = mentions(given, code) and not decoys  # every file's code said at once earns nothing
        return {"reward": 1.0 if correct else 0.0, "resolved": correct,
                "eval": {"given": given[:200], "expected": code, "correct": correct, "decoy": decoys}}
