"""Handlers by ``data_source``: short names and aliases, or a dotted path to a user's class."""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from prorl_celery.errors import UnknownPlugin
from prorl_celery.plugins import Registry, is_dotted_path, split_path
from tasks.handlers import instances
from tasks.handlers.base import AgentHandler
from tasks.handlers.check import STAGES, check_handler, conform

HANDLERS = Registry("handler", {
    "shell": "tasks.handlers.shell:ShellHandler",
    "math": "tasks.handlers.math:MathHandler",
    "stem": "tasks.handlers.stem:StemHandler",
    "echo": "tasks.handlers.echo:EchoHandler",
    "lookup": "tasks.handlers.lookup:LookupHandler",
    "code": "tasks.handlers.code:CodeHandler",
    "humaneval": "tasks.handlers.code:HumanEvalHandler",
    "swe": "tasks.swe.handler:SweHandler",
    "harbor": "tasks.harbor.handler:HarborHandler",
}, aliases={
    "deepscaler": "math", "gsm8k": "math", "aime": "math", "amc": "math",
    "swebench": "swe", "swe-gym": "swe", "r2e": "swe",
    "deepcoder": "code", "codecontests": "code", "apps": "code", "codeforces": "code", "taco": "code",
}, check=check_handler, required=STAGES)
# Each built-in handler's submission check (its check_instance calls the same function); a
# handler not listed checks what every handler does. The API uses these without the handlers.
INSTANCE_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {"swe": instances.check_swe,
                                                                   "echo": instances.check_echo,
                                                                   "lookup": instances.check_lookup,
                                                                   "harbor": instances.check_harbor,
                                                                   "shell": instances.check_no_agent}
# A built-in handler's sandbox need where it is not 1 (its sandbox_need calls the same function).
SANDBOX_NEEDS: dict[str, Callable[[dict[str, Any]], int]] = {"harbor": instances.harbor_sandbox_need}
# Built-in handler modules that moved, old -> new: a data source that names a class by its old
# dotted path (a config written before the move) still loads it.
MOVED = {"tasks.handlers.swe": "tasks.swe.handler"}


def _current(data_source: str) -> str:
    """``data_source`` with a moved module's old dotted path replaced by its new one."""
    if not is_dotted_path(data_source):
        return data_source
    module, attr = split_path(data_source)
    return f"{MOVED[module]}:{attr}" if module in MOVED else data_source


@functools.cache
def get_handler(data_source: str) -> AgentHandler:
    """The handler for a data source (checked by :func:`check_handler`); an unknown name lists
    the known ones."""
    return conform(HANDLERS.load(_current(data_source)))()


def instance_check(data_source: str) -> Callable[[dict[str, Any]], None]:
    """What checks a job's instance at submission: a built-in handler's function of
    :mod:`tasks.handlers.instances`, without importing the handler; for a dotted path, the
    class's own ``check_instance`` (the class is loaded and checked as by :func:`get_handler`).
    Raises :class:`~prorl_celery.errors.UnknownPlugin` for a data source that names no handler."""
    short = HANDLERS.canonical(_current(data_source))
    if short in HANDLERS.entries:
        return INSTANCE_CHECKS.get(short, instances.check_sandbox)
    return get_handler(data_source).check_instance


def sandbox_need(instance: dict[str, Any]) -> int:
    """The most sandboxes a job of ``instance`` holds at once (its handler's ``sandbox_need``; a
    built-in handler's without importing it), as a project's ``max_sandboxes`` counts it. The
    instance has passed :func:`instance_check`."""
    data_source = instance["data_source"]
    short = HANDLERS.canonical(_current(data_source))
    if short in HANDLERS.entries:
        need = SANDBOX_NEEDS[short](instance) if short in SANDBOX_NEEDS else 1
    else:
        need = get_handler(data_source).sandbox_need(instance)
    if isinstance(need, bool) or not isinstance(need, int) or need < 0:
        raise UnknownPlugin(f"handler {data_source}: sandbox_need returned {need!r}, not a count of sandboxes")
    return need


def sandbox_needs(instances: list[dict[str, Any]]) -> list[int]:
    """:func:`sandbox_need` of each instance, a built-in handler's worked out once per distinct
    instance (a group's samples, a batch of one task's rollouts: a Harbor folder is read once)."""
    seen: dict[str, int] = {}
    out = []
    for instance in instances:
        short = HANDLERS.canonical(_current(instance["data_source"]))
        if short in HANDLERS.entries and short not in SANDBOX_NEEDS:
            out.append(1)
            continue
        key = json.dumps(instance, sort_keys=True, default=str)
        if key not in seen:
            seen[key] = sandbox_need(instance)
        out.append(seen[key])
    return out
