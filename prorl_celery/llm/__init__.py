"""The LLM backend pool: registry, load-aware routing, health, clients and the fake server.

The agent loop calls ``LLMPool(redis).generate(job_id, LLMRequest(...), should_stop) -> Turn``.
"""
from prorl_celery.llm.models import (Backend, BackendSpec, BackendStatus, LLMRequest, Protocol,
                                     SamplingParams, ToolCall, Turn)
from prorl_celery.llm.pool import LLMPool

__all__ = ["Backend", "BackendSpec", "BackendStatus", "LLMPool", "LLMRequest", "Protocol",
           "SamplingParams", "ToolCall", "Turn"]
