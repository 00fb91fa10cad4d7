"""A Harbor task's MCP servers and skills reach the agent (examples/harbor/mcp-skills: a stdio
server the harness starts in the sandbox, a streamable-HTTP one the image's ENTRYPOINT starts on
the sandbox's loopback, a skill that says how the answer is written).

Claude Code and Codex are given both servers and the skill their own way; the fake LLM plays the
model (:mod:`prorl_celery.fakes.mcp_oracle`): it calls the MCP tools by the names the harness
offers, reads the skill, then writes the skill's template filled with the tools' answers, so the
reward is 1 only when both answers and the skill's text came back to the model. A command harness
(no MCP configuration) reaches the same servers itself and reads the skill appended to its task.
``-m harbor`` (Claude Code and Codex: ``harness`` too)."""
from __future__ import annotations

import hashlib
import json

import pytest

from tests.harbor.test_harbor_e2e import NOOP, ORACLE, result, run
from tests.harbor.test_harbor_harnesses import HARNESSES, _exact, _since
from tests.harnesses.test_mini_swe_agent import oracle_llm  # noqa: F401 - a fixture

pytestmark = pytest.mark.harbor
TASK = "mcp-skills"
FACT = hashlib.sha256(b"facts:alpha").hexdigest()[:12]
CREDITS = str(int(hashlib.sha256(b"ledger:acme").hexdigest()[:6], 16))
ANSWER = f"facts={FACT};ledger={CREDITS}"


def _after_call(messages: list[dict], tool_part: str) -> str:
    """The text of the messages the model got after its first call of a tool whose name holds
    ``tool_part`` (up to its next turn)."""
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and tool_part in json.dumps(m.get("tool_calls") or m.get("content")):
            after = []
            for later in messages[i + 1:]:
                if later["role"] == "assistant":
                    break
                after.append(json.dumps(later.get("content")))
            return "\n".join(after)
    raise AssertionError(f"no call of a {tool_part} tool in {json.dumps(messages)[-3000:]}")


@pytest.mark.parametrize("agent", [p for p in HARNESSES if p.id in ("claude_code", "codex")])
def test_a_harness_calls_the_tasks_mcp_tools_and_reads_its_skill(api, oracle_llm, agent):
    since = _since(oracle_llm)
    out = result(run(api, TASK, {**agent}))
    tools = out["harness"]["tools"]
    assert [(s["name"], s["configured"]) for s in tools["mcp_servers"]] == [("facts", True), ("ledger", True)]
    assert tools["skills"] == {"dir": "/skills", "names": ["answer-format"], "how": "installed in its skills folder"}
    assert out["reward"] == 1.0, out["harness"]["output"][-3000:]
    messages = out["messages"]
    # each tool's answer reached the model's next request; the skill was listed, then read
    assert f"alpha is {FACT}" in _after_call(messages, "lookup")
    assert f"acme holds {CREDITS} credits" in _after_call(messages, "balance")
    assert "answer-format" in json.dumps(messages[:2])
    assert "facts=<alpha>;ledger=<acme>" in json.dumps(messages)
    _exact(out, oracle_llm, since)


def test_an_agent_without_mcp_reaches_the_servers_itself_and_gets_the_skills_in_its_task(api):
    # a team's own harness: the stdio server's command is in the image; the HTTP one listens on
    # the sandbox's loopback; the skill's template is in its task
    script = r"""/opt/mcp/venv/bin/python - <<'EOF'
import asyncio, os, re
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamablehttp_client

async def ask(streams, tool, args):
    async with ClientSession(*streams[:2]) as session:
        await session.initialize()
        return (await session.call_tool(tool, args)).content[0].text

async def main():
    async with stdio_client(StdioServerParameters(command="/opt/mcp/venv/bin/python", args=["/opt/mcp/facts.py"])) as s:
        fact = re.search(r"is (\w+)", await ask(s, "lookup", {"key": "alpha"})).group(1)
    async with streamablehttp_client("http://127.0.0.1:8765/mcp") as s:
        credits = re.search(r"holds (\d+)", await ask(s, "balance", {"account": "acme"})).group(1)
    task = open(os.environ["PRORL_TASK_FILE"]).read()
    template = re.search(r"^\s*(\S*<alpha>\S*)\s*$", task, re.M).group(1)
    open("/app/answer.txt", "w").write(template.replace("<alpha>", fact).replace("<acme>", credits) + "\n")

asyncio.run(main())
EOF"""
    out = result(run(api, TASK, {"harness": "command", "command": script, "wall_s": 120}))
    tools = out["harness"]["tools"]
    assert not any(s["configured"] for s in tools["mcp_servers"])
    assert "mcp_servers were not configured for command" in tools["mcp_note"]
    assert tools["skills"]["how"] == "appended to the instruction"
    assert out["reward"] == 1.0, out["harness"]["output"][-3000:]
    assert out["harbor"]["tools"] == tools and "skills_appendix" not in out["harbor"]


def test_the_oracle_solves_the_mcp_task_and_a_noop_agent_does_not(api):
    solved = result(run(api, TASK, ORACLE))
    assert solved["reward"] == 1.0 and solved["harbor"]["tools"]["skills"]["how"].startswith("not used")
    assert result(run(api, TASK, NOOP))["reward"] == 0.0
