"""``fake``: the project's fake server's own token API (no real server has it):
``POST /generate {"prompt_ids", sampling...}`` -> ``{"response_ids", "logprobs", "finish_reason",
"weight_versions"}``. Its answers say which weight version sampled each span, and it serves both
vLLM's and SGLang's pause routes (:mod:`prorl_celery.fakes.llm.pause_api`)."""
from __future__ import annotations

from typing import Any

from prorl_celery.llm.dialects.base import Dialect, Generated, TokenWire, aborted, read_logprobs
from prorl_celery.llm.dialects.sampling import Sampling
from prorl_celery.llm.models import LLMRequest, PauseApi
from prorl_celery.llm.tokenizer import Tokenizer


class FakeWire(TokenWire):
    path = "/generate"
    sampling = Sampling()
    versioned_spans = True

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]:
        return {**self.sampling.body(request, max_tokens), "prompt_ids": prompt, "model": model,
                "skip_special_tokens": False, "logprobs": True}

    def answer(self, data: dict[str, Any]) -> Generated:
        ids = data.get("response_ids", data.get("output_ids"))
        out = Generated([int(i) for i in ids], read_logprobs(data.get("logprobs")), data.get("finish_reason"),
                        spans=data.get("weight_versions"))
        if out.finish_reason == "abort":
            raise aborted(out, "the fake server")
        return out


class Fake(Dialect):
    name = "fake"
    server = "fake"
    token = FakeWire()
    pause_apis = frozenset({PauseApi.VLLM, PauseApi.SGLANG})
