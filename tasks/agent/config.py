"""The agent's settings: what a job may ask for (:class:`AgentConfig`, from its ``sampling_params``)
and what the operator sets (:class:`Timeouts`, from the settings)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from config.settings import get_settings
from prorl_celery.llm import LLMRequest, Protocol, SamplingParams, Turn
from tasks.agent import tools


class AgentConfig(BaseModel):
    """Agent settings, read from the job's ``sampling_params`` (the reference system's names work)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    max_turns: int = Field(30, ge=1, validation_alias=AliasChoices("max_turns", "max_iterations"),
                           description="Assistant turns before the episode ends (finish_reason max_turns).")
    max_total_tokens: int | None = Field(None, ge=1, description="Generated tokens over the episode.")
    max_bad_calls: int = Field(3, ge=1, description="Consecutive malformed or unknown tool calls tolerated.")
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = Field(None, ge=1, validation_alias=AliasChoices("max_tokens", "max_output_tokens"),
                                   description="Generated tokens per turn.")
    seed: int | None = None
    tool_choice: str | dict[str, Any] | None = Field(None, description="Chat mode: passed to the server as is "
                                                                      "(\"required\" forces a tool call).")
    token_level_generation: bool | None = Field(None, description="True: generate protocol (token in/out); "
                                                                  "False: chat; None: any backend.")
    tokenizer: str | None = Field(None, validation_alias=AliasChoices("tokenizer", "custom_tokenizer"))
    max_model_len: int | None = Field(None, ge=1)
    enable_thinking: bool | None = None
    llm_timeout_s: float | None = Field(None, gt=0)

    def request(self, messages: list[dict[str, Any]], previous: Turn | None, timeout_s: float) -> LLMRequest:
        protocol = None if self.token_level_generation is None else (
            Protocol.GENERATE if self.token_level_generation else Protocol.CHAT)
        kwargs = None if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        sampling = SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                                  seed=self.seed, **({"tool_choice": self.tool_choice} if self.tool_choice else {}))
        return LLMRequest(messages=messages, tools=tools.ALL, sampling=sampling, protocol=protocol,
                          previous=previous, tokenizer=self.tokenizer, max_model_len=self.max_model_len,
                          chat_template_kwargs=kwargs, timeout_s=timeout_s)


@dataclass(frozen=True)
class Timeouts:
    """Ceilings on one LLM call and one sandbox command, in seconds (each also capped by the
    stage's remaining time)."""

    llm_call_s: float
    action_s: float

    @classmethod
    def from_settings(cls, config: AgentConfig | None = None) -> "Timeouts":
        settings = get_settings()
        llm = (config.llm_timeout_s if config else None) or settings.llm_call_timeout_s
        return cls(llm_call_s=llm, action_s=settings.action_timeout_s)
