"""What a task gives a harness beside its instruction: MCP servers and agent skills.

A task (Harbor's ``[[environment.mcp_servers]]`` and ``[environment] skills_dir``) hands them to
the run stage as :class:`AgentTools`; each harness says what it can take:

- ``mcp_transports`` (a class attribute): the MCP transports it configures in its own way
  (Claude Code: ``--mcp-config`` JSON; Codex: ``[mcp_servers.<name>]`` in its ``config.toml``).
  Empty (the default): it takes none; the servers stay reachable as the task describes them (a
  URL, a command in the image) and the result says they were not configured for it. A transport
  a harness that takes MCP cannot take is refused at submission (:func:`check_transports`).
  A ``stdio`` server's command runs inside the agent's sandbox (it comes with the image), started
  by the harness.
- ``skills_home`` (a class attribute): where, beneath ``$PRORL_HARNESS_DIR``, it reads a folder of
  skills (``<name>/SKILL.md``); the task's skills folder is copied there. None (the default):
  the skills' ``SKILL.md`` texts are appended to its instruction instead (:func:`skills_appendix`).

:func:`report` is what the result says of it, for any kind of agent.
"""
from __future__ import annotations

import shlex
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prorl_celery.errors import InvalidRequest

Transport = Literal["sse", "streamable-http", "stdio"]
SKILLS_HEADER = "## Skills available for this task"


class McpServer(BaseModel):
    """One MCP server the agent is given (Harbor's ``[[environment.mcp_servers]]`` entry)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$", description="Its name (tools are "
                      "``mcp__<name>__<tool>`` in Claude Code).")
    transport: Transport = Field("sse", description="sse or streamable-http (at url), or stdio (command).")
    url: str | None = Field(None, pattern=r"^https?://\S+$", description="Where an sse or streamable-http server "
                            "listens, as the agent's sandbox reaches it.")
    command: str | None = Field(None, min_length=1, description="A stdio server's program, run in the agent's "
                                "sandbox (it is in the image).")
    args: list[str] = Field([], description="A stdio server's arguments.")

    @model_validator(mode="after")
    def _reachable(self) -> McpServer:
        if self.transport == "stdio" and not self.command:
            raise ValueError("a stdio MCP server needs a command")
        if self.transport != "stdio" and not self.url:
            raise ValueError(f"a {self.transport} MCP server needs a url")
        return self


class AgentTools(BaseModel):
    """What the run stage hands a harness beside its instruction."""

    mcp_servers: list[McpServer] = []
    skills_dir: str | None = Field(None, description="A folder of skills in the sandbox (``<name>/SKILL.md``).")
    skills: list[str] = Field([], description="The skills' names found there.")

    def __bool__(self) -> bool:
        return bool(self.mcp_servers or self.skills_dir)


def mcp_transports(harness_cls: Any) -> frozenset[str]:
    return frozenset(getattr(harness_cls, "mcp_transports", ()) or ())


def skills_home(harness_cls: Any) -> str | None:
    return getattr(harness_cls, "skills_home", None)


def check_transports(name: str, harness_cls: Any, servers: list[McpServer],
                     prefix: str = "task.toml.environment.mcp_servers") -> None:
    """Refuse (:class:`InvalidRequest` naming ``<prefix>[i].transport``) a server whose transport
    the harness cannot take, when it takes MCP at all."""
    takes = mcp_transports(harness_cls)
    if not takes:
        return
    for i, server in enumerate(servers):
        if server.transport not in takes:
            raise InvalidRequest(f"MCP server {server.name!r}: the {name} harness cannot take transport "
                                 f"{server.transport!r} (it takes {', '.join(sorted(takes))})",
                                 field=f"{prefix}[{i}].transport")


def copy_skills(tools: AgentTools, dest: str) -> str:
    """A shell step (ending in `` && ``) that copies the task's skills folder to ``dest`` (may
    name ``$PRORL_HARNESS_DIR``); nothing when the task has none. A folder the image lacks fails
    the harness's command, loudly."""
    if not tools.skills_dir:
        return ""
    src = shlex.quote(tools.skills_dir.rstrip("/") + "/.")
    return f'mkdir -p "{dest}" && cp -R {src} "{dest}/" && '


def skills_appendix(texts: dict[str, str]) -> str:
    """The skills' SKILL.md texts as they are appended to the instruction of an agent that
    cannot load skills: a header, then each skill under ``### <name>``, by name."""
    if not texts:
        return ""
    parts = [f"\n\n{SKILLS_HEADER}\n\nThese instructions are skills this task provides; apply a skill where it "
             "fits the task."]
    for name in sorted(texts):
        parts.append(f"### {name}\n\n{texts[name].strip()}")
    return "\n\n".join(parts) + "\n"


def report(agent: str, harness_cls: Any, tools: AgentTools) -> dict[str, Any] | None:
    """What the result says of the task's MCP servers and skills for this agent (None: it has none)."""
    if not tools:
        return None
    takes, home = mcp_transports(harness_cls), skills_home(harness_cls)
    servers = [{"name": s.name, "transport": s.transport, "configured": s.transport in takes,
                **({"runs_in": "the agent's sandbox"} if s.transport == "stdio" else {"url": s.url})}
               for s in tools.mcp_servers]
    out: dict[str, Any] = {"agent": agent}
    if servers:
        out["mcp_servers"] = servers
        if not takes:
            out["mcp_note"] = (f"mcp_servers were not configured for {agent}: it takes no MCP configuration; "
                               "the servers stay reachable as the task describes them")
    if tools.skills_dir:
        if home:
            how = "installed in its skills folder"
        elif getattr(harness_cls, "reads_solution", False):
            how = "not used (it makes no LLM call)"
        else:
            how = "appended to the instruction"
        out["skills"] = {"dir": tools.skills_dir, "names": list(tools.skills), "how": how}
    return out
