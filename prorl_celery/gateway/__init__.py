"""The per-session LLM gateway: harnesses call it in their own API (OpenAI chat, OpenAI Responses,
Anthropic Messages); it renders each call with the backend's chat template, reusing the ids the
session already generated, generates through the LLM pool in token mode, and records every call
on the rollout store (see README.md)."""
from prorl_celery.gateway.models import GatewayRequest
from prorl_celery.rollout.calllog import CallLog
from prorl_celery.gateway.server import Gateway
from prorl_celery.gateway.session import Budget, BudgetSpent, GatewaySession

__all__ = ["Budget", "BudgetSpent", "CallLog", "Gateway", "GatewayRequest", "GatewaySession"]
