"""Handlers by ``data_source``: short names and aliases, or a dotted path to a user's class."""
from __future__ import annotations

import functools
import importlib

from prorl_celery.errors import UnknownPlugin
from tasks.handlers.base import AgentHandler

HANDLERS: dict[str, str] = {
    "shell": "tasks.handlers.shell:ShellHandler",
    "math": "tasks.handlers.math:MathHandler",
    "stem": "tasks.handlers.stem:StemHandler",
    "code": "tasks.handlers.code:CodeHandler",
    "humaneval": "tasks.handlers.code:HumanEvalHandler",
    "swe": "tasks.handlers.swe:SweHandler",
}
ALIASES: dict[str, str] = {
    "deepscaler": "math", "gsm8k": "math", "aime": "math", "amc": "math",
    "swebench": "swe", "swe-gym": "swe", "r2e": "swe",
    "deepcoder": "code", "codecontests": "code", "apps": "code", "codeforces": "code", "taco": "code",
}


def _import(path: str) -> type:
    module, _, attr = path.partition(":")
    if not attr:
        module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@functools.cache
def get_handler(data_source: str) -> AgentHandler:
    """The handler for a data source; an unknown name lists the known ones."""
    name = ALIASES.get(data_source, data_source)
    path = HANDLERS.get(name)
    if path is None and (":" in name or "." in name):
        path = name
    if path is None:
        known = ", ".join(sorted([*HANDLERS, *ALIASES]))
        raise UnknownPlugin(f"unknown data_source {data_source!r}; known: {known}, or a dotted path")
    try:
        return _import(path)()
    except (ImportError, AttributeError) as exc:
        raise UnknownPlugin(f"cannot load handler {path!r}: {exc}") from exc
