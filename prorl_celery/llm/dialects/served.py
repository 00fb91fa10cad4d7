"""What a server says about how it served a call, beyond the ids: the MoE routing trace of the
generated tokens (router replay, "R3") and its prefix-cache hit. Read where the real servers put
them, passed on as they are (a trainer replays the routing in the server's own layout), and absent
wherever the server did not say: never filled in.

- vLLM (0.32, every answer recorded in tests/fixtures/recorded/vllm/ has the key, ``null`` unless
  the server runs with ``--enable-return-routed-experts``): ``choices[0].routed_experts``, a list
  per generated token of a list per MoE layer of the top-k expert ids, on chat, ``/v1/completions``
  and ``/inference/v1/generate`` alike. Its prefix-cache hit: ``usage.prompt_tokens_details.
  cached_tokens`` (with ``--enable-prompt-tokens-details``; ``null`` otherwise).
- llama.cpp: ``usage.prompt_tokens_details.cached_tokens`` on chat (recorded); no routing trace.
- SGLang's ``/generate``: ``meta_info.routed_experts`` (asked for per request with
  ``return_routed_experts``, the server started with ``--enable-return-routed-experts``), the
  base64 of the int32 ids in token, layer, top-k order, and ``meta_info.cached_tokens``.
"""
from __future__ import annotations

from typing import Any, NamedTuple


class Served(NamedTuple):
    """How a call was served, as its server reported it (None: not reported)."""

    cached_tokens: int | None = None
    routed_experts: list | str | None = None


NOTHING = Served()


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _trace(value: Any) -> list | str | None:
    return value if isinstance(value, (list, str)) and value else None


def openai(data: dict[str, Any], choice: dict[str, Any]) -> Served:
    """From an OpenAI-shaped answer (vLLM's, llama.cpp's): the choice's trace, the usage's hit."""
    details = (data.get("usage") or {}).get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Served(cached, _trace(choice.get("routed_experts")))


def sglang(meta: dict[str, Any]) -> Served:
    """From SGLang's ``meta_info``."""
    return Served(_count(meta.get("cached_tokens")), _trace(meta.get("routed_experts")))
