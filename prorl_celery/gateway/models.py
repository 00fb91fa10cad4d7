"""What the gateway records and what crosses between its API dialects and its session: a call in
the caller-neutral shape (OpenAI messages and tools, our sampling set) and one recorded call."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prorl_celery.llm.models import SamplingParams


class GatewayRequest(BaseModel):
    """One caller's call, whatever API it came in: the conversation in OpenAI chat form."""

    model_config = ConfigDict(extra="forbid")

    messages: list[dict[str, Any]] = Field(description="The whole conversation, OpenAI chat messages.")
    tools: list[dict[str, Any]] | None = Field(None, description="OpenAI function tools.")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    model: str | None = Field(None, description="The model the caller named (echoed back, not routed on).")
    stream: bool = False


class CallRecord(BaseModel):
    """One completed call of a session, stored once and linearly: its prompt is the first
    ``shared`` ids of call ``base``'s context (that call's prompt + response ids) followed by
    ``prompt_tail``, so a harness that resends a 20k-token history costs only what it added."""

    index: int = Field(description="0, 1, ... in the order the calls completed.")
    api: str = Field(description="The caller's API dialect (openai_chat, anthropic_messages ...).")
    base: int | None = Field(None, description="The earlier call whose context this prompt starts with.")
    shared: int = Field(0, description="How many ids of the base call's context start this prompt.")
    prompt_tail: list[int] = Field(description="The prompt's ids past the shared ones.")
    continued: bool = Field(False, description="The prompt reuses the base call's generated ids exactly "
                                               "(built by appending, not by re-tokenising its output).")
    response_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    weight_version: str | None = None
    backend_id: str | None = None
    model: str | None = None
    message_count: int = Field(0, description="Messages of the conversation this call was sent.")
    tool_calls: int = Field(0, description="Tool calls parsed out of the generated text.")
    format_error: str | None = None
    started_at: float = 0.0
    latency_s: float = 0.0
    gateway_s: float = Field(0.0, description="Time spent in the gateway itself (render, parse, record).")
