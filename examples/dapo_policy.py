"""A fake policy for the dynamic-sampling example: it answers arithmetic prompts right with a
per-prompt probability, so some prompts are always solved, some never, most sometimes -- the mix
DAPO's dynamic sampling is about. A test and demo tool, not a model."""
from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from prorl_celery.llm.chatml import text_of
from prorl_celery.fakes.llm.policies import Reply, ReplyCall

PROBLEM = re.compile(r"What is (\d+) \* (\d+) \+ (\d+)\? \(prompt (\d+)\)")


def solve_rate(prompt_id: int) -> float:
    """Per-prompt chance of a right answer: a quarter always right, a quarter never, the rest between."""
    bucket = int(hashlib.sha256(str(prompt_id).encode()).hexdigest(), 16) % 4
    return {0: 1.0, 1: 0.0}.get(bucket, 0.25 + 0.5 * (bucket - 2))


def reply(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Reply | None:
    user = next((text_of(m.get("content")) for m in messages if m.get("role") == "user"), "")
    found = PROBLEM.search(user)
    if not found:
        return None
    a, b, c, prompt_id = (int(x) for x in found.groups())
    thinking = sum(1 for m in messages if m.get("role") == "assistant")
    if thinking < random.choice((0, 0, 1, 2, 4)):  # rollouts differ in length, as real ones do
        return Reply(tool_calls=[ReplyCall(name="bash", arguments={"command": f"python3 -c 'print({a}*{b})'"})])
    right = random.random() < solve_rate(prompt_id)
    answer = a * b + c if right else a * b + c + random.randint(1, 9)
    return Reply(tool_calls=[ReplyCall(name="submit", arguments={"answer": str(answer)})])


def problem(prompt_id: int) -> dict[str, Any]:
    rng = random.Random(prompt_id)
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(0, 99)
    return {"data_source": "math", "problem": f"What is {a} * {b} + {c}? (prompt {prompt_id})",
            "answer": str(a * b + c), "instance_id": f"arith-{prompt_id}"}
