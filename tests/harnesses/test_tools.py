"""A task's MCP servers and skills as each harness is given them: Claude Code's ``--mcp-config``
JSON, Codex's ``[mcp_servers.<name>]`` tables, the skills copied to their skills folders, the
skills appended to the instruction of an agent that loads none, the refusals and the report."""
from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from prorl_celery.errors import InvalidRequest
from tasks.harbor.config import parse
from tasks.harnesses.base import HarnessTask
from tasks.harnesses.claude_code import ClaudeCode
from tasks.harnesses.codex import Codex
from tasks.harnesses.command import CommandHarness
from tasks.harnesses.mini_swe_agent import MiniSweAgent
from tasks.harnesses.oracle import Oracle
from tasks.harnesses.tools import AgentTools, McpServer, check_transports, report, skills_appendix

pytestmark = pytest.mark.unit
STDIO = McpServer(name="facts", transport="stdio", command="/opt/mcp/venv/bin/python", args=["/opt/mcp/facts.py"])
HTTP = McpServer(name="ledger", transport="streamable-http", url="http://127.0.0.1:8765/mcp")
SSE = McpServer(name="feed", transport="sse", url="http://mcp-server:8000/sse")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "harbor" / "mcp-skills"


def _task(tools: AgentTools) -> HarnessTask:
    return HarnessTask(instruction="do it", base_url="http://127.0.0.1:9", api_key="k", model="m", wall_s=60,
                       tools=tools)


def test_claude_code_gets_every_transport_in_its_mcp_config_and_the_skills_in_its_config_dir():
    launch = ClaudeCode().launch(_task(AgentTools(mcp_servers=[STDIO, HTTP, SSE], skills_dir="/skills")),
                                 ClaudeCode.config_class())
    assert json.loads(launch.files["mcp.json"]) == {"mcpServers": {
        "facts": {"type": "stdio", "command": "/opt/mcp/venv/bin/python", "args": ["/opt/mcp/facts.py"]},
        "ledger": {"type": "http", "url": "http://127.0.0.1:8765/mcp"},
        "feed": {"type": "sse", "url": "http://mcp-server:8000/sse"}}}
    assert "--mcp-config $PRORL_HARNESS_DIR/mcp.json --strict-mcp-config" in launch.command
    # its CLAUDE_CONFIG_DIR is $PRORL_HARNESS_DIR/claude: skills/<name>/SKILL.md beneath it, copied first
    assert launch.command.startswith('mkdir -p "$PRORL_HARNESS_DIR/claude/skills" && cp -R /skills/. '
                                     '"$PRORL_HARNESS_DIR/claude/skills/" && env ')
    assert 'CLAUDE_CONFIG_DIR="$PRORL_HARNESS_DIR/claude"' in launch.command


def test_a_harness_without_tools_is_launched_as_before():
    bare = ClaudeCode().launch(_task(AgentTools()), ClaudeCode.config_class())
    assert "mcp" not in bare.command and set(bare.files) == {"task.txt"} and "skills" not in bare.command
    toml = tomllib.loads(Codex().launch(_task(AgentTools()), Codex.config_class()).files["config.toml"])
    assert "mcp_servers" not in toml


def test_codex_gets_mcp_servers_tables_in_its_config_toml_and_the_skills_in_its_home():
    launch = Codex().launch(_task(AgentTools(mcp_servers=[STDIO, HTTP], skills_dir="/skills/")), Codex.config_class())
    toml = tomllib.loads(launch.files["config.toml"])
    assert toml["mcp_servers"] == {
        "facts": {"command": "/opt/mcp/venv/bin/python", "args": ["/opt/mcp/facts.py"], "startup_timeout_sec": 60},
        "ledger": {"url": "http://127.0.0.1:8765/mcp", "startup_timeout_sec": 60}}
    assert toml["model_providers"]["prorl"]["wire_api"] == "responses"  # its own settings kept
    assert 'cp -R /skills/. "$PRORL_HARNESS_DIR/codex/skills/"' in launch.command
    assert 'CODEX_HOME="$PRORL_HARNESS_DIR/codex"' in launch.command


def test_a_transport_a_harness_cannot_take_is_refused_naming_the_server():
    with pytest.raises(InvalidRequest) as err:
        check_transports("codex", Codex, [STDIO, HTTP, SSE])
    assert err.value.field == "task.toml.environment.mcp_servers[2].transport" and "sse" in str(err.value)
    check_transports("claude_code", ClaudeCode, [STDIO, HTTP, SSE])
    for harness in (MiniSweAgent, CommandHarness, Oracle):  # no MCP at all: reported, not refused
        check_transports(harness.name, harness, [SSE])


def test_the_report_says_what_each_agent_got():
    tools = AgentTools(mcp_servers=[STDIO, HTTP], skills_dir="/skills", skills=["answer-format"])
    claude = report("claude_code", ClaudeCode, tools)
    assert [s["configured"] for s in claude["mcp_servers"]] == [True, True] and "mcp_note" not in claude
    assert claude["mcp_servers"][0]["runs_in"] == "the agent's sandbox" and claude["mcp_servers"][1]["url"] == HTTP.url
    assert claude["skills"] == {"dir": "/skills", "names": ["answer-format"], "how": "installed in its skills folder"}
    for name, cls in (("mini_swe_agent", MiniSweAgent), ("command", CommandHarness), ("builtin", None)):
        out = report(name, cls, tools)
        assert not any(s["configured"] for s in out["mcp_servers"])
        assert "mcp_servers were not configured for " + name in out["mcp_note"]
        assert out["skills"]["how"] == "appended to the instruction"
    assert report("oracle", Oracle, tools)["skills"]["how"].startswith("not used")
    assert report("claude_code", ClaudeCode, AgentTools()) is None


def test_skills_appended_to_an_instruction_are_each_under_its_name():
    text = skills_appendix({"b-skill": "---\nname: b\n---\nBody B\n", "a-skill": "Body A"})
    assert text.index("### a-skill") < text.index("Body A") < text.index("### b-skill") < text.index("Body B")
    assert text.startswith("\n\n## Skills available for this task") and skills_appendix({}) == ""


def test_task_toml_mcp_servers_and_skills_dir_are_honoured_and_malformed_ones_refused_by_name():
    config = parse((EXAMPLE / "task.toml").read_text())
    assert [s.name for s in config.environment.mcp_servers] == ["facts", "ledger"]
    assert config.environment.skills_dir == "/skills"
    for body, field in (('[[environment.mcp_servers]]\nname = "x"\ntransport = "stdio"\n',
                         "task.toml.environment.mcp_servers.0"),
                        ('[[environment.mcp_servers]]\nname = "x"\ntransport = "ws"\nurl = "http://a"\n',
                         "task.toml.environment.mcp_servers.0.transport"),
                        ('[[environment.mcp_servers]]\nname = "x"\nurl = "http://a"\nheaders = {}\n',
                         "task.toml.environment.mcp_servers.0.headers"),
                        ('[[environment.mcp_servers]]\nname = "a b"\nurl = "http://a"\n',
                         "task.toml.environment.mcp_servers.0.name"),
                        ('[[environment.mcp_servers]]\nname = "x"\nurl = "http://a"\n'
                         '[[environment.mcp_servers]]\nname = "x"\nurl = "http://b"\n',
                         "task.toml.environment.mcp_servers"),
                        ('[environment]\nskills_dir = "skills"\n', "task.toml.environment.skills_dir")):
        with pytest.raises(InvalidRequest) as err:
            parse(body)
        assert err.value.field == field, (body, err.value.field)


def test_a_harbor_instance_whose_harness_cannot_take_a_transport_is_refused_at_submission(tmp_path, monkeypatch):
    from config.settings import get_settings
    from tasks.handlers.instances import check_harbor

    task = tmp_path / "sse-task"
    shutil.copytree(EXAMPLE, task)
    toml = (task / "task.toml").read_text().replace('transport = "streamable-http"', 'transport = "sse"')
    (task / "task.toml").write_text(toml)
    monkeypatch.setenv("PRORL_HARBOR_TASK_DIRS", str(tmp_path))
    get_settings.cache_clear()
    try:
        instance = {"data_source": "harbor", "task_dir": str(task)}
        check_harbor({**instance, "agent": {"harness": "claude_code"}})
        check_harbor({**instance, "agent": {"harness": "mini_swe_agent"}})
        check_harbor(instance)
        with pytest.raises(InvalidRequest) as err:
            check_harbor({**instance, "agent": {"harness": "codex"}})
        assert err.value.field == "task.toml.environment.mcp_servers[1].transport"
    finally:
        get_settings.cache_clear()


def test_the_responses_api_renders_namespaced_tools_flat_and_answers_their_calls_in_their_namespace():
    # Codex groups an MCP server's tools in one namespace tool; a call of one must come back with it
    from prorl_celery.gateway.apis.openai_responses import OpenAIResponses
    from prorl_celery.llm.models import ToolCall, Turn

    api = OpenAIResponses()
    lookup = {"type": "function", "name": "lookup", "description": "Look up a fact",
              "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}
    body = {"model": "m", "input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "name": "lookup", "namespace": "mcp__facts", "arguments": "{}", "call_id": "c1"},
        {"type": "function_call_output", "call_id": "c1", "output": "alpha is 1"}],
        "tools": [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
                  {"type": "namespace", "name": "mcp__facts", "description": "its tools", "tools": [lookup]},
                  {"type": "web_search"}]}
    request = api.parse(body)
    assert [t["function"]["name"] for t in request.tools] == ["exec_command", "mcp__facts__lookup"]
    assert request.messages[1]["tool_calls"][0]["function"]["name"] == "mcp__facts__lookup"  # as it was generated
    turn = Turn(backend_id="b", address="a", weight_version=None, protocol="generate", model="m", content="",
                message_count=3, tool_calls=[ToolCall(id="c2", name="mcp__facts__lookup", arguments='{"key":"x"}'),
                                             ToolCall(id="c3", name="exec_command", arguments="{}")])
    calls = [i for i in api.respond(turn, request)["output"] if i["type"] == "function_call"]
    assert [(c["name"], c.get("namespace")) for c in calls] == [("lookup", "mcp__facts"), ("exec_command", None)]
    streamed = b"".join(api.stream(turn, request)).decode()
    assert '"namespace": "mcp__facts"' in streamed
