"""The per-session LLM gateway: harnesses call it in their own API (OpenAI chat today); it renders
each call with the backend's chat template, reusing the ids the session already generated,
generates through the LLM pool in token mode, and records every call (see README.md)."""
from prorl_celery.gateway.models import CallRecord, GatewayRequest
from prorl_celery.gateway.server import Gateway
from prorl_celery.gateway.session import Budget, BudgetSpent, GatewaySession
from prorl_celery.gateway.store import CallStore, MemoryCallStore, RedisCallStore

__all__ = ["Budget", "BudgetSpent", "CallRecord", "CallStore", "Gateway", "GatewayRequest", "GatewaySession",
           "MemoryCallStore", "RedisCallStore"]
