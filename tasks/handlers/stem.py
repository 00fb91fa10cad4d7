"""``stem``: ``{"question", "choices"?, "answer"}``. With choices, the answer is a letter (or the
choice's text) and is graded by letter; without, a number is graded with math-verify and anything
else by normalised exact match."""
from __future__ import annotations

import re
import string
from typing import Any

from tasks.context import StageContext
from tasks.handlers.agentic import AgentTaskHandler, final_answer
from tasks.verify.answers import choice_letter, last_boxed, math_equal

SYSTEM = ("Answer the question. You may use the bash tool to compute. Call submit with only the final "
          "answer: the letter of the right choice when choices are given, else a short answer.")


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower().strip(string.punctuation + " "))


class StemHandler(AgentTaskHandler):
    name = "stem"
    default_sandbox = {"limits": {"memory_mb": 2048, "cpu_s": 60, "nproc": 64}}

    def prompt(self, ctx: StageContext) -> list[dict[str, Any]]:
        text = str(ctx.instance["question"])
        choices = ctx.instance.get("choices") or []
        if choices:
            text += "\n\n" + "\n".join(f"{string.ascii_uppercase[i]}. {c}" for i, c in enumerate(choices))
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]

    def _expected_letter(self, choices: list[str], answer: str) -> str:
        if len(answer.strip()) == 1 and answer.strip().upper() in string.ascii_uppercase[: len(choices)]:
            return answer.strip().upper()
        for i, choice in enumerate(choices):
            if _normal(str(choice)) == _normal(answer):
                return string.ascii_uppercase[i]
        return answer.strip().upper()

    def score(self, ctx: StageContext) -> dict[str, Any]:
        submitted, text = final_answer(ctx.state)
        given = submitted if submitted else (last_boxed(text) or text)
        answer, choices = str(ctx.instance["answer"]), ctx.instance.get("choices") or []
        if choices:
            expected = self._expected_letter(choices, answer)
            got = choice_letter(given, string.ascii_uppercase[: len(choices)])
            correct = got == expected
        else:
            expected, got = answer, given
            correct = _normal(given or "") == _normal(answer) or math_equal(given, answer)
        return {"reward": 1.0 if correct else 0.0, "resolved": correct,
                "eval": {"given": got, "expected": expected, "correct": correct}}
