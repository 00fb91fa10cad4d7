"""Pydantic models at the LLM pool's boundaries: backends, requests, and the generated turn."""
from __future__ import annotations

import json
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError


class Protocol(str, Enum):
    """How a backend is spoken to."""

    CHAT = "chat"          # OpenAI chat completions (text in, text + tool calls out)
    GENERATE = "generate"  # token in, token out: {"prompt_ids", ...} -> {"response_ids", "logprobs"}


class PauseApi(str, Enum):
    """The server's own pause around a weight update (see :mod:`prorl_celery.llm.pause`)."""

    VLLM = "vllm"      # POST /pause?mode=keep|abort, /resume (vLLM with VLLM_SERVER_DEV_MODE=1)
    SGLANG = "sglang"  # POST /pause_generation, /continue_generation
    NONE = "none"      # none: the service drains it


class BackendStatus(str, Enum):
    ACTIVE = "active"            # takes new requests
    DRAINING = "draining"        # finishes what it has, takes nothing new (checkpoint swap)
    QUARANTINED = "quarantined"  # failed; probed until it answers again


class BackendSpec(BaseModel):
    """What registers a backend (``POST /llm_servers``)."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field(description="Base URL, http://host:port with or without a trailing /v1.")
    capacity: int | None = Field(None, ge=1, le=100000,
                                 description="Sequences it runs at once; default llm_default_capacity.")
    protocol: Protocol = Field(Protocol.CHAT, description="chat (OpenAI-compatible) or generate (token ids).")
    dialect: str | None = Field(None, description="The server's API (prorl_celery/llm/dialects): generate needs "
                                                  "one of fake, sglang, vllm-completions, vllm-generate, "
                                                  "llama.cpp; chat takes openai, vllm (default), nemo-gym, "
                                                  "sglang, llama.cpp.")
    model: str | None = Field(None, description="Model name to send; default: the first of /v1/models.")
    weight_version: str | None = Field(None, description="Version of the weights it serves now.")
    max_model_len: int | None = Field(None, ge=1, description="Context window; token mode keeps within it.")
    tokenizer: str | None = Field(None, description="Token mode: tokenizer name (default: the model name).")
    api_key: str | None = Field(None, description="Bearer token the server requires, if any.")
    logprobs_mode: str | None = Field(None, description="Which logprobs the server reports, e.g. vLLM's "
                                                        "--logprobs-mode (raw_logprobs, processed_logprobs); "
                                                        "default: the dialect's known default.")
    pause_api: PauseApi | None = Field(None, description="The server's own pause around weight updates: vllm "
                                                         "(/pause, /resume; vLLM needs VLLM_SERVER_DEV_MODE=1), "
                                                         "sglang (/pause_generation), none (default: drained).")
    probe: bool = Field(True, description="Check before registering that the server answers the protocol and "
                                          "dialect (and tools, and token ids, when asked for); false only for "
                                          "a server that is not up yet.")
    tools: bool = Field(False, description="Rollouts will send tools: the probe checks that a tool call is "
                                           "accepted.")
    exact_tokens: bool = Field(False, description="The trainer needs exact token ids: the probe checks that "
                                                  "they come back.")
    routed_experts: bool | None = Field(None, description="The server runs with --enable-return-routed-experts: "
                                                          "SGLang's calls ask for the MoE routing trace "
                                                          "(return_routed_experts); vLLM returns it unasked.")
    tool_parser: str | None = Field(None, description="The format the model writes tool calls in, read out of "
                                                      "its text in token mode (and in chat mode when the server "
                                                      "returns raw text): hermes (default), llama3_json, mistral, "
                                                      "qwen3_coder, pythonic.")

    @field_validator("tool_parser")
    @classmethod
    def _known_tool_parser(cls, value: str | None) -> str | None:
        from prorl_celery.llm.tool_parsers import PARSERS

        if value is not None and value not in PARSERS:
            raise ValueError(f"unknown tool-call format {value!r}; known: {', '.join(sorted(PARSERS))}")
        return value

    @field_validator("dialect")
    @classmethod
    def _known_dialect(cls, value: str | None) -> str | None:
        from prorl_celery.errors import UnknownPlugin
        from prorl_celery.llm import dialects

        if value is not None:
            try:
                dialects.get(value)
            except UnknownPlugin as exc:
                raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _dialect_of_protocol(self) -> "BackendSpec":
        """A generate backend names its wire (there is no default token API that real servers share);
        a chat backend takes only chat dialects."""
        from prorl_celery.llm import dialects

        serves = dialects.get(self.dialect).protocols() if self.dialect is not None else frozenset()
        if self.protocol is Protocol.GENERATE:
            if Protocol.GENERATE not in serves:
                raise PydanticCustomError(
                    "dialect", "the generate protocol needs the server's token API, one of {names}",
                    {"loc": "dialect", "names": ", ".join(dialects.serving(Protocol.GENERATE))})
        elif self.dialect is not None and Protocol.CHAT not in serves:
            raise PydanticCustomError(
                "dialect", "'{name}' is a wire format of the generate protocol: set protocol to "
                "generate (chat takes {names})",
                {"loc": "dialect", "name": self.dialect, "names": ", ".join(dialects.serving(Protocol.CHAT))})
        return self


class Backend(BaseModel):
    """A registered backend as stored in Redis, with its live counters."""

    id: str
    address: str
    project: str | None = Field(None, description="The project it is private to (None: shared, the operator's).")
    protocol: Protocol
    dialect: str | None = None
    capacity: int
    status: BackendStatus
    model: str | None = None
    weight_version: str | None = None
    max_model_len: int | None = None
    tokenizer: str | None = None
    logprobs_mode: str | None = None
    pause_api: PauseApi | None = None
    tool_parser: str | None = Field(None, description="Tool-call format of the model's text (None: hermes).")
    routed_experts: bool = Field(False, description="Ask each call for the MoE routing trace (SGLang).")
    paused_mode: str | None = Field(None, description="While paused for a weight update: keep, abort or drain.")
    paused_until: float | None = Field(None, description="While paused: when the pause expires if no resume comes.")
    pause_expired_at: float | None = Field(None, description="When its last pause expired with no resume: it went on "
                                                             "with the weight version it had (cleared by the next pause).")
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None
    added_at: float = 0.0
    status_since: float = 0.0

    def public(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class SamplingParams(BaseModel):
    """The full sampling set every request states (each dialect in its own names), so no server
    fills a gap from the model's generation config. The defaults sample from the very distribution
    the logprobs are read from: no truncation (top_k 0 = off, sent as -1 or 0 as the dialect needs;
    top_p 1; min_p 0) and no penalty (repetition_penalty 1). Unknown keys (min_tokens, ignore_eos ...)
    pass through to the server."""

    model_config = ConfigDict(extra="allow")

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1: off.")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    max_tokens: int | None = Field(None, ge=1, description="Cap on generated tokens of one turn; always sent "
                                                           "(default: the room the context leaves, else 1024).")
    seed: int | None = None
    stop: list[str] | None = None
    tool_choice: str | dict[str, Any] | None = Field(None, description="Chat: passed through (auto, required, "
                                                                       "none, or a named function).")


class WeightSegment(BaseModel):
    """Response ids ``[start, end)`` of a turn were sampled by the weights of ``version``."""

    version: str | None
    start: int = Field(ge=0)
    end: int = Field(ge=0)


def merge_segments(segments: list[WeightSegment]) -> list[WeightSegment]:
    """Empty segments dropped, neighbours of one version joined."""
    out: list[WeightSegment] = []
    for seg in segments:
        if seg.end <= seg.start:
            continue
        if out and out[-1].version == seg.version and out[-1].end == seg.start:
            out[-1] = WeightSegment(version=seg.version, start=out[-1].start, end=seg.end)
        else:
            out.append(seg)
    return out


class PartialResponse(BaseModel):
    """What a turn had generated when a weight update aborted it (token mode): the turn goes on
    from these ids (prompt + partial sent again), and they are kept with their versions."""

    response_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    segments: list[WeightSegment] = Field(default_factory=list)
    continued: int = Field(0, description="Times the turn was continued after an abort.")


class LLMRequest(BaseModel):
    """One turn to generate. ``messages`` is the whole conversation in OpenAI format."""

    model_config = ConfigDict(extra="forbid")

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    protocol: Protocol | None = Field(None, description="Only backends of this protocol; default any "
                                                        "(a continuation keeps the previous turn's).")
    previous: Turn | None = Field(None, description="The rollout's last turn; token mode appends to its ids.")
    model: str | None = None
    tokenizer: str | None = Field(None, description="Token mode: overrides the backend's tokenizer.")
    max_model_len: int | None = Field(None, ge=1, description="Context window, if the backend does not say.")
    chat_template_kwargs: dict[str, Any] | None = None
    partial: PartialResponse | None = Field(None, description="Token mode: the turn's ids so far, generated "
                                                              "before a weight update aborted it; continued from.")
    timeout_s: float | None = Field(
        None, gt=0, description="Per-call timeout; default llm_call_timeout_s. A backend that exceeds the full "
                                "llm_call_timeout_s is quarantined and the call retried elsewhere; a shorter "
                                "timeout is the caller's own deadline: LLMTimeout, no retry, no quarantine.")


class ToolCall(BaseModel):
    id: str
    name: str
    arguments: str = Field(description="The arguments as the model wrote them (JSON text).")

    def args(self) -> Any:
        """The arguments parsed; raises ValueError when the model wrote invalid JSON."""
        return json.loads(self.arguments) if self.arguments.strip() else {}

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class Turn(BaseModel):
    """One generated assistant turn and everything a trainer needs to learn from it."""

    backend_id: str
    address: str
    weight_version: str | None
    protocol: Protocol
    model: str | None
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: str | None = None
    prompt_ids: list[int] | None = Field(None, description="Exact prompt token ids the server saw.")
    response_ids: list[int] | None = Field(None, description="Exact generated token ids.")
    logprobs: list[float] | None = Field(None, description="One per response id.")
    logprobs_mode: str | None = Field(None, description="Which distribution the logprobs come from (raw_logprobs: "
                                                        "the model's own, before any sampling transform; "
                                                        "processed_logprobs: after temperature and truncation).")
    token_source: Literal["server", "local", "none"] = Field(
        "none", description="server: ids reported by the server; local: prompt built here (token mode).")
    message_count: int = Field(description="Messages the prompt was built from; the next turn's new "
                                           "messages start after this turn's own assistant message.")
    format_error: str | None = Field(None, description="'tool_call' (unparseable) or 'length' (cut off).")
    weight_segments: list[WeightSegment] | None = Field(
        None, description="Which response ids each weight version sampled (a turn spanning an update has "
                          "more than one); None where not known (chat mode: the whole turn is weight_version's).")
    continued: int = Field(0, description="Times a weight update aborted the turn and it went on from its ids.")
    cached_tokens: int | None = Field(None, description="Prompt tokens the server's prefix cache held, as it "
                                                        "reported them (None: it did not say).")
    routed_experts: list | str | None = Field(
        None, description="The MoE routing trace of the generated ids, as the server returned it (vLLM: a list per "
                          "token of a list per layer of expert ids; SGLang: base64 int32); None: not returned, or "
                          "the turn was continued after an abort (the trace of its first part is lost).")
    attempts: int = 1
    started_at: float = 0.0
    latency_s: float = 0.0

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message to append to the conversation (OpenAI format)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return out


LLMRequest.model_rebuild()
