"""Handlers by ``data_source``: short names and aliases, or a dotted path to a user's class."""
from __future__ import annotations

import functools

from prorl_celery.plugins import Registry
from tasks.handlers.base import AgentHandler
from tasks.handlers.check import check_handler, conform

HANDLERS = Registry("handler", {
    "shell": "tasks.handlers.shell:ShellHandler",
    "math": "tasks.handlers.math:MathHandler",
    "stem": "tasks.handlers.stem:StemHandler",
    "code": "tasks.handlers.code:CodeHandler",
    "humaneval": "tasks.handlers.code:HumanEvalHandler",
    "swe": "tasks.handlers.swe:SweHandler",
}, aliases={
    "deepscaler": "math", "gsm8k": "math", "aime": "math", "amc": "math",
    "swebench": "swe", "swe-gym": "swe", "r2e": "swe",
    "deepcoder": "code", "codecontests": "code", "apps": "code", "codeforces": "code", "taco": "code",
}, check=check_handler)


@functools.cache
def get_handler(data_source: str) -> AgentHandler:
    """The handler for a data source (checked by :func:`check_handler`); an unknown name lists
    the known ones."""
    return conform(HANDLERS.load(data_source))()
