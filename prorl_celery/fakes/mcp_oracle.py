"""The fake LLM's player for the example Harbor task ``mcp-skills`` (a test tool, not a model), in
Claude Code's and Codex's own tools: it calls the task's two MCP tools as the harness offers them
(``mcp__facts__lookup``, ``mcp__ledger__balance``), reads the ``answer-format`` skill (Claude
Code's ``Skill`` tool; Codex: the SKILL.md its skills list names, with its shell), then writes
the skill's template filled with what the tools answered. Each move follows from what the
conversation holds so far, so the answer it writes is right only when the tools' answers and the
skill's text reached the model. Anything else: None (the harness oracle goes on).
"""
from __future__ import annotations

import json
import re
from typing import Any

from prorl_celery.fakes import oracle
from prorl_celery.fakes.llm.policies import Reply
from prorl_celery.llm.chatml import text_of

INSTRUCTION = (oracle.HARBOR / "mcp-skills" / "instruction.md")
FACT = re.compile(r"alpha is ([0-9a-f]{12})")
CREDITS = re.compile(r"acme holds (\d+) credits")
TEMPLATE = re.compile(r"^\s*(\S*<alpha>\S*)\s*$", re.M)
SKILL_FILE = re.compile(r"(/[^\s`'\"()]*answer-format/SKILL\.md)")


def _tool(system: str, server: str, tool: str) -> str | None:
    """The name the harness gave the server's tool (as the prompt lists its tools)."""
    found = re.search(rf'"name":\s*"([A-Za-z0-9_.:-]*{server}[A-Za-z0-9_.:-]*{tool})"', system)
    return found.group(1) if found else None


def _seen(messages: list[dict[str, Any]]) -> str:
    """What came back to the model: every message but the system prompt and its own."""
    return "\n".join(text_of(m.get("content")) for m in messages if m.get("role") not in ("system", "assistant"))


def reply(messages: list[dict[str, Any]], shell: Any, kind: str) -> Reply | None:
    """``shell(command)``: the harness's shell call; ``kind``: ``claude_code`` or ``codex``."""
    seen = _seen(messages)
    if not INSTRUCTION.is_file() or INSTRUCTION.read_text().strip() not in seen:
        return None
    system = text_of(messages[0].get("content")) if messages and messages[0].get("role") == "system" else ""
    mine = json.dumps([m for m in messages if m.get("role") == "assistant"])
    fact, credits, template = FACT.search(seen), CREDITS.search(seen), TEMPLATE.search(seen)
    if not fact:
        name = _tool(system, "facts", "lookup")
        return oracle._call(name, key="alpha") if name else Reply(content="The facts server offers no lookup tool.")
    if not credits:
        name = _tool(system, "ledger", "balance")
        return oracle._call(name, account="acme") if name else Reply(content="The ledger server offers no balance tool.")
    if not template:
        if kind == "claude_code":
            return oracle._call("Skill", skill="answer-format")
        path = SKILL_FILE.search(system + "\n" + seen)
        return shell(f"cat {path.group(1)}") if path else Reply(content="No answer-format skill is listed.")
    answer = template.group(1).replace("<alpha>", fact.group(1)).replace("<acme>", credits.group(1))
    if answer not in mine:
        return shell(f"printf '%s\\n' '{answer}' > /app/answer.txt")
    return Reply(content="The answer is written.")
