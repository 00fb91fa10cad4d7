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
SKILL_FILE = re.compile(r"\(file: ([^\s()]*answer-format/SKILL\.md)\)")
WAIT = "sleep 2"
ROOT = re.compile(r"`(\w+)` = `(/[^`]+)`")  # Codex's skill roots table: a short alias -> a folder


def _tool(offered: str, server: str, tool: str) -> str | None:
    """The name the harness gave the server's tool (as the prompt lists its tools)."""
    found = re.search(rf'"name":\s*"([A-Za-z0-9_.:-]*{server}[A-Za-z0-9_.:-]*{tool})"', offered)
    return found.group(1) if found else None


def _seen(messages: list[dict[str, Any]]) -> str:
    """What came back to the model: every message but the system prompt and its own."""
    return "\n".join(text_of(m.get("content")) for m in messages if m.get("role") not in ("system", "assistant"))


def _offered(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """Where the harness's tools are listed: the system messages as rendered, and the tools."""
    system = [text_of(m.get("content")) for m in messages if m.get("role") == "system"]
    return "\n".join(system) + json.dumps(tools or [])


def _wait_or(mine: str, shell: Any, what: str) -> Reply:
    """A tool not offered yet (a harness may list a server's tools once it has started): wait a
    little with the shell, a few times, then say so."""
    if mine.count(WAIT) < 5:
        return shell(WAIT)
    return Reply(content=f"The {what} tool is not offered.")



def reply(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, shell: Any, kind: str) -> Reply | None:
    """``shell(command)``: the harness's shell call; ``kind``: ``claude_code`` or ``codex``."""
    seen = _seen(messages)
    if not INSTRUCTION.is_file() or INSTRUCTION.read_text().strip() not in seen:
        return None
    system = _offered(messages, tools)
    mine = json.dumps([m for m in messages if m.get("role") == "assistant"])
    fact, credits, template = FACT.search(seen), CREDITS.search(seen), TEMPLATE.search(seen)
    if not fact:
        name = _tool(system, "facts", "lookup")
        return oracle._call(name, key="alpha") if name else _wait_or(mine, shell, "facts lookup")
    if not credits:
        name = _tool(system, "ledger", "balance")
        return oracle._call(name, account="acme") if name else _wait_or(mine, shell, "ledger balance")
    if not template:
        if kind == "claude_code":
            return oracle._call("Skill", skill="answer-format")
        listed = "\n".join(text_of(m.get("content")) for m in messages if m.get("role") != "assistant")
        path = SKILL_FILE.search(listed)
        if not path:
            return Reply(content="No answer-format skill is listed.")
        alias, _, rest = path.group(1).partition("/")
        return shell(f"cat {dict(ROOT.findall(listed)).get(alias, alias)}/{rest}")
    answer = template.group(1).replace("<alpha>", fact.group(1)).replace("<acme>", credits.group(1))
    if answer not in mine:
        return shell(f"printf '%s\\n' '{answer}' > /app/answer.txt")
    return Reply(content="The answer is written.")
