"""``openai``: the OpenAI API's chat completions, strict fields only (the API answers 400
"Unrecognized request argument" to vLLM's extras: no ``top_k``, ``min_p``, ``repetition_penalty``,
no ``return_token_ids``). No token ids come back."""
from __future__ import annotations

from prorl_celery.llm.dialects.base import Dialect
from prorl_celery.llm.dialects.chat_wire import ChatWire
from prorl_celery.llm.dialects.sampling import Sampling


class OpenAIChat(ChatWire):
    sampling = Sampling(names={"top_k": None, "min_p": None, "repetition_penalty": None}, top_k_off=None)


class OpenAI(Dialect):
    name = "openai"
    server = "openai"
    chat = OpenAIChat()
    probe_hints = {"exact_tokens": "none: the OpenAI API returns no token ids; use dialect vllm or llama.cpp"}
