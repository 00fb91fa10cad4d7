"""An agent that submits the answer its task names (a test tool, played by the fake LLM server).

``--policy oracle:tests.tasks.math_flood_policy:reply``: a problem that says ``Submit exactly:
<answer>`` gets ``submit(answer)`` on the first turn, hostile answers included.
"""
from __future__ import annotations

from typing import Any

from prorl_celery.fakes.llm.policies import Reply, ReplyCall
from prorl_celery.llm.chatml import text_of

MARK = "Submit exactly: "


def reply(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Reply | None:
    text = next((text_of(m.get("content")) for m in messages if m.get("role") == "user"), "")
    if MARK not in text:
        return None
    return Reply(content="", tool_calls=[ReplyCall(name="submit", arguments={"answer": text.split(MARK, 1)[1].strip()})])
