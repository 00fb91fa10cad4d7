"""llama.cpp's answer shapes for the fake server (test and demo tool), as recorded from its real
server (``tests/fixtures/recorded/llamacpp``): the ``/v1/models`` card, ``generation_settings``
of ``/completion``, and its OpenAI ``/v1/completions`` (logprobs as chat-style entries)."""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prorl_celery.fakes.llm.state import FakeLLM

# llama.cpp's sampler defaults, overridden by the request's own values
SETTINGS: dict[str, Any] = {
    "seed": 4294967295, "temperature": 0.8, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_k": 40,
    "top_p": 0.95, "min_p": 0.05, "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
    "typical_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
    "dry_penalty_last_n": 64, "dry_sequence_breakers": ["\n", ":", "\"", "*"], "mirostat": 0,
    "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0, "adaptive_decay": 0.9, "stop": [],
    "max_tokens": -1, "n_predict": -1, "n_keep": 0, "n_discard": 0, "ignore_eos": False, "stream": False,
    "logit_bias": [], "n_probs": 0, "min_keep": 0, "grammar": "", "grammar_lazy": False, "grammar_triggers": [],
    "preserved_tokens": [], "chat_format": "Content-only", "reasoning_format": "deepseek",
    "reasoning_in_content": False, "generation_prompt": "", "samplers": ["top_k", "top_p", "min_p", "temperature"],
    "speculative.types": "none", "timings_per_token": False, "post_sampling_probs": False,
    "backend_sampling": False, "lora": []}


def generation_settings(body: dict[str, Any]) -> dict[str, Any]:
    settings = {**SETTINGS, **{k: v for k, v in body.items() if k in SETTINGS}}
    if "n_predict" in body:
        settings["max_tokens"] = body["n_predict"]
    return settings


def models(fake: FakeLLM) -> dict[str, Any]:
    """``GET /v1/models``: Ollama-style ``models`` beside OpenAI's ``data``, ``meta.n_ctx`` the window."""
    listing = {"name": fake.model, "model": fake.model, "modified_at": "", "size": "", "digest": "", "type": "model",
               "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
               "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                           "parameter_size": "", "quantization_level": ""}}
    card = {"id": fake.model, "aliases": [fake.model], "tags": [], "object": "model",
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "created": int(time.time()), "owned_by": "llamacpp",
            "meta": {"vocab_type": 2, "n_vocab": getattr(fake.tok, "vocab_size", 0), "n_ctx": fake.max_model_len,
                     "n_ctx_train": fake.max_model_len, "n_embd": 0, "n_params": 0, "size": 0, "ftype": "F32"}}
    return {"models": [listing], "object": "list", "data": [card]}


def oai_completion(fake: FakeLLM, body: dict[str, Any], prompt: list[int], entry: dict[str, Any],
                   text: str, probs: list[dict[str, Any]] | None, timings: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's ``/v1/completions`` answer."""
    ids = entry["response_ids"]
    choice = {"text": text, "index": 0, "logprobs": {"content": probs} if probs is not None else None,
              "finish_reason": entry["finish_reason"]}
    return {"choices": [choice], "created": int(time.time()), "model": body.get("model") or fake.model,
            "system_fingerprint": "b0-prorl-fake", "object": "text_completion",
            "usage": {"completion_tokens": len(ids), "prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids),
                      "prompt_tokens_details": {"cached_tokens": entry.get("cached_tokens", 0)}},
            "id": f"chatcmpl-{uuid.uuid4().hex}", "timings": timings}
