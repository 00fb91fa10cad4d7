"""``claude_code``: Anthropic's Claude Code (npm ``@anthropic-ai/claude-code``; its native binary,
installed once per node by ``scripts/install-harnesses.sh claude-code``), run headless
(``claude -p``) with every permission granted, its Anthropic Messages calls aimed at the gateway,
telemetry, updates and other traffic off. Its tools run in the sandbox it was started in."""
from __future__ import annotations

import glob
import json
import os

from pydantic import BaseModel, ConfigDict, Field

from tasks.harnesses.base import HARNESS_DIR, HarnessTask, Launch, env_prefix, gateway_env
from tasks.harnesses.tools import McpServer, copy_skills

MCP_TYPE = {"stdio": "stdio", "sse": "sse", "streamable-http": "http"}  # its --mcp-config's "type"


class ClaudeCodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(30, ge=1, description="Its own turn limit (--max-turns).")


def claude_binary() -> str:
    """The native binary from the operator's harness directory, else ``claude`` on PATH."""
    root = os.environ.get("PRORL_HARNESS_ROOT", "/opt/prorl-harnesses")
    found = sorted(glob.glob(os.path.join(root, "claude-code", "node_modules", "@anthropic-ai",
                                          "claude-code-linux-*", "claude")))
    return found[0] if found else "claude"


def mcp_config(servers: list[McpServer]) -> dict:
    """Its ``--mcp-config`` JSON: ``{"mcpServers": {name: {"type", "command", "args"} or {"type", "url"}}}``."""
    def entry(s: McpServer) -> dict:
        where = {"command": s.command, "args": list(s.args)} if s.transport == "stdio" else {"url": s.url}
        return {"type": MCP_TYPE[s.transport], **where}

    return {"mcpServers": {s.name: entry(s) for s in servers}}


class ClaudeCode:
    name = "claude_code"
    config_class = ClaudeCodeConfig
    mcp_transports = frozenset(MCP_TYPE)
    skills_home = "claude/skills"  # beneath CLAUDE_CONFIG_DIR, where it reads a user's skills

    def launch(self, task: HarnessTask, config: ClaudeCodeConfig) -> Launch:
        env = {**gateway_env(task), "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1", "IS_SANDBOX": "1",
               # its allocator reserves arenas up front: under a sandbox's address-space cap (a node
               # without a memory cgroup) an error path then dies of SIGILL instead of failing
               "MIMALLOC_ARENA_RESERVE": "0",
               "CLAUDE_CONFIG_DIR": f"{HARNESS_DIR}/claude"}
        turns = min(config.max_turns, task.max_calls) if task.max_calls else config.max_turns
        files = {"task.txt": task.instruction}
        mcp = ""
        if task.tools.mcp_servers:
            files["mcp.json"] = json.dumps(mcp_config(task.tools.mcp_servers), indent=1)
            env["MCP_TIMEOUT"] = "60000"  # a server's start, in ms (a stdio one starts in the sandbox)
            mcp = f" --mcp-config {HARNESS_DIR}/mcp.json --strict-mcp-config"
        command = (f"{copy_skills(task.tools, f'{HARNESS_DIR}/{self.skills_home}')}"
                   f"{env_prefix(env)} {claude_binary()} -p \"$(cat {HARNESS_DIR}/task.txt)\" "
                   f"--dangerously-skip-permissions --model {task.model} --max-turns {turns} "
                   f"--output-format json{mcp}")
        return Launch(files=files, command=command)

    def finish_reason(self, exit_code: int | None, output: str) -> str | None:
        if '"subtype":"error_max_turns"' in output.replace(" ", ""):
            return "step_limit"
        if exit_code == 0 and '"subtype":"success"' in output.replace(" ", ""):
            return "submitted"
        return None
