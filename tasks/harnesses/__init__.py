"""Harnesses: black-box agents run in the sandbox against their session's gateway (see README.md).
``HARNESSES`` is the family's registry; a harness of your own is an allowed dotted path away."""
from __future__ import annotations

from prorl_celery.plugins import Registry
from tasks.harnesses.check import check_harness

HARNESSES = Registry("harness", {
    "mini_swe_agent": "tasks.harnesses.mini_swe_agent:MiniSweAgent",
    "command": "tasks.harnesses.command:CommandHarness",
    "claude_code": "tasks.harnesses.claude_code:ClaudeCode",
    "codex": "tasks.harnesses.codex:Codex",
    "oracle": "tasks.harnesses.oracle:Oracle",
    "replay": "tasks.harnesses.replay:Replay",
}, aliases={"mini-swe-agent": "mini_swe_agent", "claude-code": "claude_code"}, check=check_harness)


def is_harness_agent(instance: dict) -> bool:
    """Whether the instance asks for a harness (``"agent": {"harness": ...}``), not the built-in agent."""
    agent = instance.get("agent")
    return isinstance(agent, dict) and "harness" in agent


def check_instance_agent(instance: dict) -> None:
    """Refuse at submission an instance whose ``agent`` block asks for a harness it cannot run
    (:func:`check_agent`); the built-in agent's settings are the sampling parameters'."""
    if is_harness_agent(instance):
        check_agent(instance["agent"])


def check_agent(agent: dict) -> None:
    """Refuse at submission an ``agent`` block that names no known harness or that its harness's
    config does not accept: :class:`~prorl_celery.errors.InvalidRequest` naming the field."""
    from pydantic import ValidationError

    from prorl_celery.errors import InvalidRequest, UnknownPlugin
    from tasks.harnesses.base import HarnessSpec

    try:
        spec = HarnessSpec.model_validate(agent)
        HARNESSES.load(spec.harness).config_class.model_validate(spec.own_config())
    except UnknownPlugin as exc:
        raise InvalidRequest(str(exc), field="instance.agent.harness") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise InvalidRequest(f"agent.{where}: {err['msg']}", field=f"instance.agent.{where}".rstrip(".")) from None
