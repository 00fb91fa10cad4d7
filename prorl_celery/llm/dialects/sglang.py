"""SGLang: its OpenAI-compatible chat and its native token API, both as dialect ``sglang``. Its
servers pause with ``pause_api: sglang`` (``/pause_generation``, ``/continue_generation``).

- chat: vLLM's sampling names (and it survives a seed), no ``return_token_ids``: no token ids;
- generate: ``POST /generate {"input_ids", "sampling_params": {"max_new_tokens", ...},
  "return_logprob": true}`` -> ``{"output_ids", "meta_info": {"output_token_logprobs": [[logprob,
  id, text], ...], "completion_tokens", "finish_reason": {"type": "stop" | "length" | "abort"}}}``;
  it refuses ``max_new_tokens >= context - len(prompt)`` (so the clip leaves one token), some
  versions put the prompt in front of ``output_ids`` (the last ``completion_tokens`` are taken,
  cross-checked with the logprobs' ids), older ones reject ``sampling_seed`` (resent without it,
  and never sent again to that server), and ``abort`` (a weight update) is retried without
  quarantine. Register ``max_model_len``: without it, SGLang's default ``max_new_tokens`` (128)
  caps a turn.
"""
from __future__ import annotations

from typing import Any

from prorl_celery.errors import BackendAborted, BackendFailed, LLMRequestRejected, LogprobMismatch
from prorl_celery.llm.dialects import served
from prorl_celery.llm.dialects.base import Dialect, Generated, TokenWire, aborted, read_logprobs
from prorl_celery.llm.dialects.chat_wire import ChatWire
from prorl_celery.llm.dialects.sampling import Sampling
from prorl_celery.llm.models import LLMRequest, PauseApi
from prorl_celery.llm.tokenizer import Tokenizer

_no_seed: set[str] = set()  # addresses that rejected sampling_seed


class SGLangChat(ChatWire):
    sampling = Sampling()  # vLLM's names, and it survives a seed


class SGLangWire(TokenWire):
    path = "/generate"
    sampling = Sampling(names={"max_tokens": "max_new_tokens", "seed": "sampling_seed",
                               "min_tokens": "min_new_tokens"})
    context_margin = 1  # SGLang: max_new_tokens >= context - len(prompt) is refused
    routed_experts_request = {"return_routed_experts": True}

    def __init__(self, seed: bool = True):
        self.seed = seed

    def at(self, address: str) -> TokenWire:
        return _UNSEEDED if address in _no_seed else self

    def after_refusal(self, address: str, refused: LLMRequestRejected) -> TokenWire | None:
        if not self.seed or "sampling_seed" not in str(refused):
            return None
        _no_seed.add(address)  # an SGLang without seeded sampling: the same request, unseeded
        return _UNSEEDED

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]:
        params = self.sampling.body(request, max_tokens)
        if not self.seed:
            params.pop("sampling_seed", None)
        # stop at the template's end of turn even where the model's generation config has another EOS
        params.setdefault("stop_token_ids", sorted(tok.stop_ids))
        params.setdefault("skip_special_tokens", False)
        return {"input_ids": prompt, "sampling_params": params, "return_logprob": True}

    def answer(self, data: dict[str, Any]) -> Generated:
        meta = data.get("meta_info") or {}
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        triples = meta.get("output_token_logprobs")
        if kind == "abort":
            raise _aborted(data, meta, finish, triples)
        from_logprobs = [int(t[1]) for t in triples] if triples is not None else None
        ids = data.get("output_ids")
        # SGLang before output_ids: the ids come with the logprobs
        ids = from_logprobs if ids is None else _generated([int(i) for i in ids], meta)
        if ids is None:
            raise BackendFailed("SGLang answered neither output_ids nor output_token_logprobs")
        if from_logprobs is not None and from_logprobs != ids:
            raise LogprobMismatch(f"SGLang: output_ids ({len(ids)}) and the logprobs' ids "
                                  f"({len(from_logprobs)}) disagree")
        return Generated(ids, read_logprobs(triples), kind, served=served.sglang(meta))


def _generated(ids: list[int], meta: dict[str, Any]) -> list[int]:
    """The generated ids of ``output_ids``: its last ``completion_tokens`` (versions that prefix
    the prompt)."""
    count = meta.get("completion_tokens")
    return ids[len(ids) - count:] if isinstance(count, int) and len(ids) > count else ids


def _aborted(data: dict[str, Any], meta: dict[str, Any], finish: Any, triples: Any) -> BackendAborted:
    """An answer SGLang aborted (a weight update), with the ids it had generated."""
    message = finish.get("message") if isinstance(finish, dict) else None
    ids = [int(t[1]) for t in triples or []] or [int(i) for i in data.get("output_ids") or []]
    if not ids:
        return BackendAborted(f"SGLang aborted the request: {message}")
    return aborted(Generated(_generated(ids, meta), read_logprobs(triples), "abort"), f"SGLang ({message})")


_UNSEEDED = SGLangWire(seed=False)


class SGLang(Dialect):
    name = "sglang"
    server = "sglang"
    chat = SGLangChat()
    token = SGLangWire()
    pause_apis = frozenset({PauseApi.SGLANG})
    probe_hints = {"tools": "--tool-call-parser", "exact_tokens": "none: use the generate protocol with dialect sglang"}
