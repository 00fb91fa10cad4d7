"""The request bodies :class:`prorl_celery.integrations.serve.LiveModelServer` takes, each field in
vLLM's meaning and within what its engine computes safely; anything else is a 400 naming the field,
never ignored and never passed on to the engine.

Bounds (beyond vLLM's own): ``temperature`` up to :data:`~.live_rows.TEMPERATURE_MAX` (below
:data:`~.live_rows.GREEDY_BELOW` it is greedy), ``repetition_penalty`` in
:data:`~.live_rows.REPETITION_PENALTY_RANGE`, ``seed`` in what a torch generator takes, no
``NaN`` or infinities anywhere, and every token id (prompt and ``stop_token_ids``) inside the
model's vocabulary (validated with ``context={"vocab": n}``). ``max_tokens`` is not bounded here:
the server clips it to its per-call cap and to the room the context leaves.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from prorl_celery.integrations.live_rows import REPETITION_PENALTY_RANGE, SEED_RANGE, TEMPERATURE_MAX


def _in_vocab(ids: list[int], info: ValidationInfo) -> list[int]:
    vocab = (info.context or {}).get("vocab")
    bad = next((i for i in ids if i < 0 or (vocab is not None and i >= vocab)), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the model's vocabulary (0..{(vocab or 0) - 1})")
    return ids


class Sampling(BaseModel):
    """The sampling fields both token routes take; a field the server cannot honour is refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_tokens: int = Field(16, ge=1, description="Clipped to the server's per-call cap and the context's room.")
    temperature: float = Field(1.0, ge=0, le=TEMPERATURE_MAX, description="Below 1e-5: greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 or 0: off.")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = Field(None, ge=0, le=0, description="0: the sampled token's logprob only.")
    n: int = Field(1, ge=1, le=1)

    @field_validator("stop")
    @classmethod
    def _no_stop_strings(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError("stop strings are not served here; use stop_token_ids")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_in_vocab(cls, value: list[int], info: ValidationInfo) -> list[int]:
        return _in_vocab(value, info)


class CompletionRequest(Sampling):
    """The ``/v1/completions`` fields the ``vllm-completions`` wire sends; anything else is refused."""

    model: str | None = None
    prompt: list[int] = Field(min_length=1, description="Token ids (a text prompt is not served).")
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    echo: bool = Field(False)
    stream: bool = Field(False)

    @field_validator("echo", "stream")
    @classmethod
    def _off(cls, value: bool) -> bool:
        if value:
            raise ValueError("not served here")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_in_vocab(cls, value: list[int], info: ValidationInfo) -> list[int]:
        return _in_vocab(value, info)


class GenerateParams(Sampling):
    """``sampling_params`` of ``/inference/v1/generate``: vLLM's ``SamplingParams`` fields the
    ``vllm-generate`` wire sends; what this server cannot honour is refused, never ignored."""

    presence_penalty: float = Field(0.0, ge=0, le=0, description="not served here")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="not served here")
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateParams = Field(default_factory=GenerateParams)
    model: str | None = None
    request_id: str | None = None
    output_mode: str = "tokens"
    stream: bool = Field(False)

    @field_validator("stream")
    @classmethod
    def _off(cls, value: bool) -> bool:
        if value:
            raise ValueError("not served here")
        return value

    @field_validator("token_ids")
    @classmethod
    def _prompt_in_vocab(cls, value: list[int], info: ValidationInfo) -> list[int]:
        return _in_vocab(value, info)
