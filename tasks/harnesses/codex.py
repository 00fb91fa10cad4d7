"""``codex``: OpenAI's Codex CLI (npm ``@openai/codex``; its native binary, installed once per node
by ``scripts/install-harnesses.sh codex``), ``codex exec`` with approvals and its own sandbox off
(ours is the sandbox), a model provider in its ``config.toml`` that speaks the Responses API to the
gateway. Its ``exec_command`` calls run in the sandbox it was started in."""
from __future__ import annotations

import glob
import os

from pydantic import BaseModel, ConfigDict

from tasks.harnesses.base import HARNESS_DIR, HarnessTask, Launch, env_prefix, gateway_env
from tasks.harnesses.tools import McpServer, copy_skills


class CodexConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


def codex_binary() -> str:
    """The native binary from the operator's harness directory, else ``codex`` on PATH."""
    root = os.environ.get("PRORL_HARNESS_ROOT", "/opt/prorl-harnesses")
    found = sorted(glob.glob(os.path.join(root, "codex", "node_modules", "@openai", "codex-linux-*", "vendor",
                                          "*", "bin", "codex")))
    return found[0] if found else "codex"


def _toml(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def mcp_tables(servers: list[McpServer]) -> str:
    """Its ``config.toml`` tables ``[mcp_servers.<name>]``: ``command``/``args`` for a stdio server,
    ``url`` for a streamable HTTP one (it speaks no SSE)."""
    out = []
    for s in servers:
        out.append(f"\n[mcp_servers.{s.name}]\nstartup_timeout_sec = 60\n")
        if s.transport == "stdio":
            out.append(f"command = {_toml(s.command or '')}\nargs = [{', '.join(_toml(a) for a in s.args)}]\n")
        else:
            out.append(f"url = {_toml(s.url or '')}\n")
    return "".join(out)


class Codex:
    name = "codex"
    config_class = CodexConfig
    mcp_transports = frozenset({"stdio", "streamable-http"})
    skills_home = "codex/skills"  # $CODEX_HOME/skills, where it reads a user's skills

    def launch(self, task: HarnessTask, config: CodexConfig) -> Launch:
        toml = (f"model = {_toml(task.model)}\nmodel_provider = \"prorl\"\n\n[model_providers.prorl]\n"
                f"name = \"prorl\"\nbase_url = {_toml(task.base_url + '/v1')}\nenv_key = \"PRORL_GATEWAY_KEY\"\n"
                "wire_api = \"responses\"\n\n[analytics]\nenabled = false\n") + mcp_tables(task.tools.mcp_servers)
        env = {**gateway_env(task), "CODEX_HOME": f"{HARNESS_DIR}/codex"}
        command = (f"mkdir -p {HARNESS_DIR}/codex && cp {HARNESS_DIR}/config.toml {HARNESS_DIR}/codex/ && "
                   f"{copy_skills(task.tools, f'{HARNESS_DIR}/{self.skills_home}')}"
                   f"{env_prefix(env)} {codex_binary()} exec --skip-git-repo-check "
                   f"--dangerously-bypass-approvals-and-sandbox \"$(cat {HARNESS_DIR}/task.txt)\"")
        return Launch(files={"config.toml": toml, "task.txt": task.instruction}, command=command)

    def finish_reason(self, exit_code: int | None, output: str) -> str | None:
        return "submitted" if exit_code == 0 else None
