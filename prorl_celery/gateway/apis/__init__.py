"""The gateway's caller-API dialects, one module each, on one registry (name -> dotted path)."""
from __future__ import annotations

from prorl_celery.plugins import Registry

DIALECTS = Registry("gateway API dialect", {
    "openai_chat": "prorl_celery.gateway.apis.openai_chat:OpenAIChat",
    "openai_responses": "prorl_celery.gateway.apis.openai_responses:OpenAIResponses",
    "anthropic_messages": "prorl_celery.gateway.apis.anthropic_messages:AnthropicMessages",
}, paths=False)


def load_all() -> dict[tuple[str, str], tuple[object, str]]:
    """(method, path) -> (an instance of the dialect that serves it, ``complete`` or ``count``)."""
    routes: dict[tuple[str, str], tuple[object, str]] = {}
    for name in DIALECTS.entries:
        dialect = DIALECTS.load(name)()
        for route in dialect.routes:
            routes[route] = (dialect, "complete")
        for route in getattr(dialect, "count_routes", ()):
            routes[route] = (dialect, "count")
    return routes
