"""The sampling set in one server's names: every request states the full set (see
:class:`~prorl_celery.llm.models.SamplingParams`), each wire in the names its server reads."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from config.settings import get_settings
from prorl_celery.llm.models import LLMRequest

DEFAULT_MAX_TOKENS = 1024
_CHAT_ONLY = ("tool_choice",)


@dataclass(frozen=True)
class Sampling:
    """How one server names the sampling set."""

    names: Mapping[str, str | None] = field(default_factory=dict)
    """Our name -> the server's; ``None``: the server has no such field (left out). Unlisted: as is."""
    top_k_off: int | None = -1
    """The value the server reads as "top_k off" (0 or -1 in ours); None: leave top_k out."""
    seed_gated: bool = False
    """The seed goes only when the operator says the server survives one (``llm_vllm_send_seed``:
    vLLM-CPU kills its engine on a seeded chunked prefill, see :mod:`prorl_celery.llm.dialects.vllm`)."""

    def body(self, request: LLMRequest, max_tokens: int | None = None, chat: bool = False) -> dict[str, Any]:
        """The request's full sampling set in these names, with ``max_tokens`` always set on token
        APIs (the caller's clip, else the request's, else DEFAULT_MAX_TOKENS; vLLM's
        /v1/completions would default to 16) and top_k's off value the one the server takes.
        ``tool_choice`` only on chat requests."""
        params = request.sampling.model_dump(exclude_none=True)
        if self.seed_gated and not get_settings().llm_vllm_send_seed:
            params.pop("seed", None)
        if not chat:  # a chat server's own default is the room its context leaves (it tokenises the prompt)
            params["max_tokens"] = max_tokens or params.get("max_tokens") or DEFAULT_MAX_TOKENS
        if params.get("top_k", 0) in (0, -1):
            params["top_k"] = self.top_k_off
        if not chat:
            for key in _CHAT_ONLY:
                params.pop(key, None)
        table = self.names
        out: dict[str, Any] = {}
        for key, value in params.items():
            name = table.get(key, key)
            if name is not None and value is not None:
                out[name] = value
        return out
