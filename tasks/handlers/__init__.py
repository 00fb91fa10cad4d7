"""Handlers by ``data_source``: short names and aliases, or a dotted path to a user's class."""
from __future__ import annotations

import functools

from prorl_celery.errors import UnknownPlugin
from prorl_celery.plugins import is_dotted_path, load_class
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


@functools.cache
def get_handler(data_source: str) -> AgentHandler:
    """The handler for a data source; an unknown name lists the known ones."""
    name = ALIASES.get(data_source, data_source)
    path = HANDLERS.get(name)
    if path is None and is_dotted_path(name):
        path = name
    if path is None:
        known = ", ".join(sorted([*HANDLERS, *ALIASES]))
        raise UnknownPlugin(f"unknown data_source {data_source!r}; known: {known}, or a dotted path")
    cls = load_class(path, "handler")
    missing = [name for name in ("init", "run", "eval") if not callable(getattr(cls, name, None))]
    if missing:
        raise UnknownPlugin(f"handler {path!r} has no {', '.join(missing)}")
    if not issubclass(cls, AgentHandler):  # a class of the user's own: the optional hooks' defaults
        cls = type(cls.__name__, (cls, AgentHandler), {"__module__": cls.__module__})
    return cls()
