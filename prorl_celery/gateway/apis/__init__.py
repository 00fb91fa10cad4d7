"""The gateway's caller-API dialects, one module each, on one registry (name -> dotted path)."""
from __future__ import annotations

from prorl_celery.plugins import Registry

DIALECTS = Registry("gateway API dialect", {
    "openai_chat": "prorl_celery.gateway.apis.openai_chat:OpenAIChat",
}, paths=False)


def load_all() -> dict[tuple[str, str], object]:
    """(method, path) -> an instance of the dialect that serves it."""
    routes: dict[tuple[str, str], object] = {}
    for name in DIALECTS.entries:
        dialect = DIALECTS.load(name)()
        for route in dialect.routes:
            routes[route] = dialect
    return routes
