"""Handlers by ``data_source``: short names and aliases, or a dotted path to a user's class."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

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
