"""The trainer's live model server (prorl_celery/integrations/serve.py) on a tiny random Llama built
here (nothing downloaded; a decode step takes about a millisecond), for the tests that attack it.

Needs torch (``scripts/install-trainers.sh``); without it these tests skip, saying so.
"""
from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import requests

VOCAB = 320  # the byte tokenizer's ids (0-255 and its specials from 256) fit
EOS = 300
MAX_MODEL_LEN = 4096


def tiny_model() -> Any:
    """A 2-layer Llama with random weights (seeded: the same model in every run)."""
    torch = pytest.importorskip("torch", reason="the live server needs torch (scripts/install-trainers.sh)")
    from transformers import LlamaConfig, LlamaForCausalLM

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN)
        return LlamaForCausalLM(config).eval()
    finally:
        torch.random.set_rng_state(generator_state)


def tiny_tokenizer() -> Any:
    """What the server reads of a tokenizer: its eos and pad ids and ``decode``."""
    return types.SimpleNamespace(eos_token_id=EOS, pad_token_id=None,
                                 decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))


def live_server(**options: Any) -> Iterator[Any]:
    """A started :class:`LiveModelServer` on the tiny model (``options`` passed on), stopped after."""
    model = tiny_model()
    from prorl_celery.integrations.serve import LiveModelServer

    server = LiveModelServer(model, tiny_tokenizer(), **options).start()
    try:
        yield server
    finally:
        server.stop()


def generate(server: Any, prompt: list[int], timeout: float = 120, **params: Any) -> requests.Response:
    """``POST /inference/v1/generate`` with the server's token (8 tokens, logprobs, unless said)."""
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 8, "logprobs": 0, **params}}
    return requests.post(f"{server.url}/inference/v1/generate", json=body, timeout=timeout,
                         headers={"Authorization": f"Bearer {server.api_key}"})
