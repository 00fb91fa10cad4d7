"""The harness interface: a black-box agent the run stage starts in the sandbox, pointed at its
session's gateway.

A harness class has ``name``, ``config_class`` (a pydantic model of its own settings,
``extra="forbid"``), ``launch(task, config) -> Launch`` (the files to put in place and the command
line, run in the sandbox's shell in the task's working directory) and ``finish_reason(exit_code,
output) -> str | None`` (what its exit says: ``submitted``, ``step_limit`` ...; None: nothing).
Optional class attributes say what else it takes (:mod:`tasks.harnesses.tools`): ``mcp_transports``
and ``skills_home``.
"""
from __future__ import annotations

import shlex
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field

from tasks.harnesses.tools import AgentTools

HARNESS_DIR = "$PRORL_HARNESS_DIR"  # in a launch's command: the directory its files were put in


class HarnessSpec(BaseModel):
    """``instance["agent"]`` for a harness: the harness, its budget; the rest is its own config."""

    model_config = ConfigDict(extra="allow")

    harness: str = Field(description="A registered name (mini_swe_agent, command) or an allowed dotted path.")
    max_calls: int | None = Field(None, ge=1, description="LLM calls through the gateway.")
    max_tokens: int | None = Field(None, ge=1, description="Generated tokens over all calls.")
    wall_s: float | None = Field(None, gt=0, description="Seconds the harness may run (else the run "
                                                         "stage's remaining budget).")
    model: str = Field("prorl-policy", description="The model name the harness is told to use.")

    def own_config(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class HarnessTask(BaseModel):
    """What a harness is started with."""

    instruction: str = Field(description="The task, as the harness's first user message.")
    base_url: str = Field(description="The gateway's root (no /v1), as seen from inside the sandbox.")
    api_key: str = Field(description="The session's credential.")
    socket_path: str | None = Field(None, description="The gateway's unix socket, for a harness that speaks "
                                                      "HTTP over one (base_url reaches it too).")
    model: str
    max_calls: int | None = None
    wall_s: float
    tools: AgentTools = Field(default_factory=AgentTools, description="The task's MCP servers and skills "
                              "(:mod:`tasks.harnesses.tools`), for a harness that takes them.")


class Launch(BaseModel):
    files: dict[str, str] = Field(default_factory=dict, description="Name -> text, put in HARNESS_DIR.")
    command: str = Field(description="The shell command line (may use $PRORL_HARNESS_DIR).")


class Harness(Protocol):
    name: ClassVar[str]
    config_class: ClassVar[type[BaseModel]]

    def launch(self, task: HarnessTask, config: Any) -> Launch: ...

    def finish_reason(self, exit_code: int | None, output: str) -> str | None: ...


def gateway_env(task: HarnessTask) -> dict[str, str]:
    """The variables the common SDKs read for their endpoint and key (OpenAI, Anthropic, LiteLLM)."""
    return {"OPENAI_BASE_URL": f"{task.base_url}/v1", "OPENAI_API_BASE": f"{task.base_url}/v1",
            "OPENAI_API_KEY": task.api_key, "ANTHROPIC_BASE_URL": task.base_url, "ANTHROPIC_API_KEY": task.api_key,
            "PRORL_GATEWAY_URL": task.base_url, "PRORL_GATEWAY_KEY": task.api_key, "PRORL_MODEL": task.model,
            "PRORL_GATEWAY_SOCKET": task.socket_path or "", "NO_PROXY": "*", "no_proxy": "*"}


def env_prefix(env: dict[str, str]) -> str:
    """``env K=V ...`` for a shell line; a value naming HARNESS_DIR is left for the shell to expand."""
    def quote(value: str) -> str:
        return f'"{value}"' if value.startswith(HARNESS_DIR) and '"' not in value else shlex.quote(value)

    return "env " + " ".join(f"{k}={quote(v)}" for k, v in env.items())
