"""``math`` (aliases deepscaler, gsm8k, aime, amc): ``{"problem", "answer"}``.

The answer is the ``submit`` answer, else the last ``\\boxed{}`` of the final message; it is
verified with math-verify, so equivalent forms (``0.5``, ``1/2``, ``\\frac{1}{2}``) match.
"""
from __future__ import annotations

from typing import Any

from tasks.context import StageContext
from tasks.handlers.agentic import AgentTaskHandler, final_answer
from tasks.verify.answers import check_math, last_boxed
from tasks.verify.math_pool import Verdict

SYSTEM = ("You are solving a math problem. You can run Python with the bash tool (python3 -c ...) to "
          "check your work. When you are sure, call submit with the final answer only, e.g. 42 or "
          "\\frac{3}{4}. Alternatively end your reply with \\boxed{answer}.")


class MathHandler(AgentTaskHandler):
    name = "math"
    default_sandbox = {"limits": {"memory_mb": 2048, "cpu_s": 60, "nproc": 64}}

    def prompt(self, ctx: StageContext) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(ctx.instance["problem"])}]

    def instruction(self, ctx: StageContext) -> str:
        return f"{ctx.instance['problem']}\n\nEnd your final message with the answer as \\boxed{{answer}}."

    def score(self, ctx: StageContext) -> dict[str, Any]:
        submitted, text = final_answer(ctx.state)
        given = submitted if submitted else last_boxed(text)
        expected = str(ctx.instance["answer"])
        check = check_math(given, expected)
        correct = check is not None and check.verdict is Verdict.EQUAL
        facts = {"check": check.verdict.value, "check_s": round(check.seconds, 3)} if check else {}
        return {"reward": 1.0 if correct else 0.0, "resolved": correct,
                "eval": {"given": given, "expected": expected, "correct": correct, **facts}}
