"""What the fake LLM server's endpoints share (test and demo tool; see
:mod:`prorl_celery.fakes.llm.server`): the error answer and each real server's error body, each
server's context-window rule, and the answer pieces several endpoints carry (usage, llama.cpp's
timings and probability entries), as recorded from the real servers (``tests/fixtures/recorded``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prorl_celery.fakes.llm.state import FakeLLM

FINGERPRINT = "vllm-0.32.0-prorlfake"


class HTTPError(Exception):
    """An error answer; ``body`` is the server's own error JSON when it has one."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError",
                 body: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.type, self.body = status, type_, body


def vllm_error(status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> HTTPError:
    return HTTPError(status, message, type_, {"error": {"message": message, "type": type_, "param": param,
                                                        "code": status}})


def llamacpp_error(status: int, message: str, type_: str = "invalid_request_error", **extra: Any) -> HTTPError:
    return HTTPError(status, message, type_, {"error": {"code": status, "message": message, "type": type_,
                                                        **extra}})


def sglang_error(status: int, message: str) -> HTTPError:
    return HTTPError(status, message, "ValueError", {"error": {"message": message}})


def vllm_max_tokens(fake: FakeLLM, prompt: list[int], asked: int | None, default: int | None) -> int:
    """vLLM 0.32's rule, as recorded: a prompt that fills the window is a 400 (its tokenizer stops
    at the window + 1, hence "at least"); a max_tokens past the window is clipped to the room
    left (finish ``length``), not refused; no max_tokens means ``default`` (16 on
    /v1/completions) or, for chat, the whole room."""
    limit = fake.max_model_len
    if len(prompt) >= limit:
        seen = min(len(prompt), limit + 1)
        raise vllm_error(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                              f"contains at least {seen} input tokens, which exceeds this limit even without any "
                              f"output tokens. Please reduce the length of the input prompt. "
                              f"(parameter=input_tokens, value={seen})", param="input_tokens")
    max_tokens = asked if asked is not None else (default if default is not None else limit - len(prompt))
    return min(max_tokens, limit - len(prompt))


def llamacpp_max_tokens(fake: FakeLLM, prompt: list[int], asked: int | None) -> int:
    """llama.cpp's rule: a prompt that fills the context is refused; generation stops where the
    context ends (``n_predict`` -1 or absent: no other limit)."""
    n_ctx = fake.max_model_len
    if len(prompt) >= n_ctx:
        raise llamacpp_error(400, f"request ({len(prompt)} tokens) exceeds the available context size "
                                  f"({n_ctx} tokens), try increasing it",
                             "exceed_context_size_error", n_prompt_tokens=len(prompt), n_ctx=n_ctx)
    room = n_ctx - len(prompt)
    return room if asked is None or asked < 0 else min(asked, room)


def check_max_tokens(asked: Any, limit: int) -> None:
    """vLLM refuses a max_tokens above the whole window (one within it is clipped to the room)."""
    if isinstance(asked, int) and asked > limit:
        raise vllm_error(400, f"max_tokens={asked} cannot be greater than max_model_len={limit}. Please request "
                              f"fewer output tokens. (parameter=max_tokens, value={asked})", param="max_tokens")


def vllm_usage(prompt: list[int], ids: list[int], fake: FakeLLM | None = None,
               entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's usage; its prefix-cache hit only as started with --enable-prompt-tokens-details."""
    details = None
    if fake is not None and entry is not None and fake.options.prompt_tokens_details:
        details = {"cached_tokens": entry.get("cached_tokens", 0)}
    return {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids), "completion_tokens": len(ids),
            "prompt_tokens_details": details, "completion_tokens_details": None}


def llamacpp_probs(fake: FakeLLM, ids: list[int], top: int) -> list[dict[str, Any]]:
    """llama.cpp's per-token probability entries (``n_probs`` / chat ``logprobs``); the sampled
    token stands in for each of the ``top`` alternatives."""
    out = []
    for t, lp in zip(ids, fake.logprobs(ids)):
        entry = {"id": t, "token": fake.tok.decode([t]), "bytes": list(fake.tok.decode([t]).encode()), "logprob": lp}
        out.append({**entry, "top_logprobs": [dict(entry) for _ in range(top)]})
    return out


def usage(prompt: list[int], ids: list[int]) -> dict[str, Any]:
    return {"completion_tokens": len(ids), "prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids)}


def timings(prompt: list[int], ids: list[int]) -> dict[str, Any]:
    return {"cache_n": 0, "prompt_n": len(prompt), "prompt_ms": 1.0, "prompt_per_token_ms": 1.0,
            "prompt_per_second": 1000.0, "predicted_n": len(ids), "predicted_ms": 1.0,
            "predicted_per_token_ms": 1.0, "predicted_per_second": 1000.0}
