"""What crosses between the gateway's API dialects and its session: a call in the caller-neutral
shape (OpenAI messages and tools, our sampling set). A recorded call is a rollout store record
(:class:`prorl_celery.rollout.store.Call`: :mod:`prorl_celery.rollout.calllog`)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prorl_celery.llm.models import SamplingParams


class GatewayRequest(BaseModel):
    """One caller's call, whatever API it came in: the conversation in OpenAI chat form."""

    model_config = ConfigDict(extra="forbid")

    messages: list[dict[str, Any]] = Field(description="The whole conversation, OpenAI chat messages.")
    tools: list[dict[str, Any]] | None = Field(None, description="OpenAI function tools.")
    namespaced: dict[str, tuple[str, str]] = Field(default_factory=dict, description="A tool's rendered name -> "
                                                   "(namespace, name), for tools the caller grouped in namespaces.")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    model: str | None = Field(None, description="The model the caller named (echoed back, not routed on).")
    stream: bool = False

