"""A Harbor task's ``[[environment.mcp_servers]]`` and ``[environment] skills_dir``, for its agent.

Each harness takes them as it reads them (:mod:`tasks.harnesses.tools`: Claude Code's
``--mcp-config``, Codex's ``[mcp_servers.<name>]``; the skills folder copied to its own skills
folder). An agent that takes no MCP configuration (mini-swe-agent, a command, the built-in agent,
the oracle) runs without it: the servers stay where the task says (a URL, a command in the
image), and ``harbor.tools`` (and a harness's ``harness.tools``) says ``configured: false`` with
why. An agent that loads no skills gets the skills' ``SKILL.md`` texts appended to its first
instruction (:func:`tasks.harnesses.tools.skills_appendix`). A transport a harness that takes MCP
cannot take is refused at submission, naming ``task.toml.environment.mcp_servers[i].transport``.

The skills are read at init from the agent's sandbox by its host (``export_tree``: the image's
folder as it is, never a tool's copy); a ``skills_dir`` with no ``<name>/SKILL.md`` in the image
is an init fault naming it.
"""
from __future__ import annotations

from typing import Any

from tasks.harbor import files
from tasks.harbor.task import HarborTask
from tasks.harnesses.tools import AgentTools, check_transports, report, skills_appendix, skills_home

SKILLS_MAX_BYTES = 16 * 1024 * 1024
BUILTIN = "builtin"


def _harness(instance: dict[str, Any]) -> tuple[str, Any]:
    """(the agent's name, its harness class or None for the built-in agent)."""
    from tasks.harnesses import HARNESSES, is_harness_agent

    if not is_harness_agent(instance):
        return BUILTIN, None
    name = instance["agent"]["harness"]
    return name, HARNESSES.load(name)


def check(task: HarborTask, instance: dict[str, Any]) -> None:
    """At submission: every MCP server's transport is one the instance's harness takes (when it
    takes MCP at all). An unknown harness is the agent check's to refuse."""
    from prorl_celery.errors import UnknownPlugin

    try:
        name, harness_cls = _harness(instance)
    except UnknownPlugin:
        return
    if harness_cls is not None:
        check_transports(name, harness_cls, task.config.environment.mcp_servers)


def read_skills(box: Any, skills_dir: str) -> dict[str, str]:
    """Skill name -> its SKILL.md text, from the sandbox's ``skills_dir`` as its host reads it."""
    top = skills_dir.strip("/")
    found = files.members(box.export_tree([skills_dir], SKILLS_MAX_BYTES), files.TEXT_LIMIT)
    out = {}
    for path, entry in found.items():
        parts = path[len(top):].strip("/").split("/") if path.startswith(top + "/") else []
        if len(parts) == 2 and parts[1] == "SKILL.md":
            out[parts[0]] = entry.get("text") or ""
    if not out:
        raise RuntimeError(f"task.toml's skills_dir {skills_dir!r}: the image has no <name>/SKILL.md there")
    return out


def prepare(box: Any, task: HarborTask, instance: dict[str, Any], block: dict[str, Any]) -> None:
    """At init, in the agent's sandbox: the skills' names (and, for an agent that loads no
    skills, the appendix to its first instruction) and the report, kept in the task's block."""
    env = task.config.environment
    if not env.mcp_servers and not env.skills_dir:
        return
    name, harness_cls = _harness(instance)
    texts = read_skills(box, env.skills_dir) if env.skills_dir else {}
    tools = AgentTools(mcp_servers=env.mcp_servers, skills_dir=env.skills_dir, skills=sorted(texts))
    block["tools"] = report(name, harness_cls, tools)
    if texts and not skills_home(harness_cls) and not getattr(harness_cls, "reads_solution", False):
        block["skills_appendix"] = skills_appendix(texts)


def agent_tools(task: HarborTask, block: dict[str, Any]) -> AgentTools | None:
    env = task.config.environment
    if not env.mcp_servers and not env.skills_dir:
        return None
    names = ((block.get("tools") or {}).get("skills") or {}).get("names") or []
    return AgentTools(mcp_servers=env.mcp_servers, skills_dir=env.skills_dir, skills=names)
