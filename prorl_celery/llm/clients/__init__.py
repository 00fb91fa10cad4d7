"""One client per backend protocol: how a turn is asked of a server that speaks it (``base.Client``),
found by the protocol's name in one registry."""
from __future__ import annotations

import functools

from prorl_celery.llm.clients.base import Client
from prorl_celery.llm.models import Protocol
from prorl_celery.plugins import Registry

CLIENTS = Registry("LLM protocol", {
    Protocol.CHAT.value: "prorl_celery.llm.clients.chat:ChatClient",
    Protocol.GENERATE.value: "prorl_celery.llm.clients.generate:GenerateClient",
}, paths=False)


@functools.cache
def client_for(protocol: Protocol | str) -> Client:
    """The (stateless, shared) client of ``protocol``."""
    return CLIENTS.load(Protocol(protocol).value)()
