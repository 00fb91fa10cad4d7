"""``chat`` protocol: OpenAI chat completions with tools and logprobs, in the backend's dialect:

- ``openai``: strict OpenAI fields only (no ``return_token_ids``, no top_k / min_p /
  repetition_penalty, which the OpenAI API rejects);
- ``vllm`` (the default): plus vLLM's sampling fields and ``return_token_ids`` (vLLM >= 0.10.2:
  the exact prompt and response ids);
- ``sglang``: vLLM's sampling names, no ``return_token_ids``;
- ``llama.cpp``: ``repeat_penalty``, top_k 0 = off, a fixed sampler chain, logprobs of the raw
  distribution (``post_sampling_probs`` false); each logprob entry carries its token ``id``, so
  the response ids are exact (the prompt ids are not reported).

A logprob count other than the response's token count is a :class:`LogprobMismatch` (retried
on another backend), never padded.
"""
from __future__ import annotations

from typing import Any

from prorl_celery.errors import BackendFailed, LogprobMismatch
from prorl_celery.llm import chatml
from prorl_celery.llm.base import model_name, post, sampling_body
from prorl_celery.llm.models import Dialect, LLMRequest, ToolCall, Turn
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.transport import Call

# The logprob definition a dialect's server uses unless the backend was registered with another.
DEFAULT_LOGPROBS_MODE = {Dialect.VLLM: "raw_logprobs", Dialect.LLAMACPP: "raw_logprobs"}
LLAMACPP_SAMPLERS = ["top_k", "top_p", "min_p", "temperature"]


def chat_body(slot: Slot, request: LLMRequest, model: str, max_tokens: int | None = None) -> dict[str, Any]:
    """The request body in the backend's dialect (also used by the registration probe)."""
    dialect = slot.dialect or Dialect.VLLM
    names = {Dialect.OPENAI: "openai", Dialect.LLAMACPP: "llama.cpp", Dialect.SGLANG: "sglang-chat"}.get(dialect, "vllm")
    body: dict[str, Any] = {"model": model, "messages": request.messages, "logprobs": True,
                            **sampling_body(request, names, max_tokens, chat=True)}
    if dialect is Dialect.VLLM:
        body["return_token_ids"] = True
    elif dialect is Dialect.LLAMACPP:
        body["samplers"] = LLAMACPP_SAMPLERS
        body["post_sampling_probs"] = False
    if request.tools:
        body["tools"] = request.tools
    if request.chat_template_kwargs:
        body["chat_template_kwargs"] = request.chat_template_kwargs
    return body


class ChatClient:
    def generate(self, slot: Slot, request: LLMRequest, call: Call) -> Turn:
        body = chat_body(slot, request, model_name(slot, request))
        data = post(slot, "/v1/chat/completions", body, call)
        try:
            return self._turn(slot, request, body["model"], data)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise BackendFailed(f"{slot.address}: malformed chat completion: {exc!r}") from None

    @staticmethod
    def _turn(slot: Slot, request: LLMRequest, model: str, data: dict[str, Any]) -> Turn:
        choice = data["choices"][0]
        message = choice["message"]
        content = message.get("content")
        calls = [ToolCall(id=c.get("id") or f"call_{i}", name=c["function"]["name"],
                          arguments=c["function"].get("arguments") or "")
                 for i, c in enumerate(message.get("tool_calls") or [])]
        malformed = False
        if request.tools and not calls and content and chatml.TOOL_CALL in content:
            content, calls, malformed = chatml.split_tool_calls(content)  # server had no tool parser
        entries = (choice.get("logprobs") or {}).get("content") or []
        response_ids = choice.get("token_ids") or data.get("response_token_ids")
        if response_ids is None and entries and all("id" in e for e in entries):
            response_ids = [int(e["id"]) for e in entries]  # llama.cpp: each entry names its token
        prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
        logprobs = [float(e["logprob"]) for e in entries] or None
        _check_counts(slot, logprobs, response_ids, (data.get("usage") or {}).get("completion_tokens"))
        finish = choice.get("finish_reason")
        return Turn(backend_id=slot.backend_id, address=slot.address, weight_version=slot.weight_version,
                    protocol=slot.protocol, model=model, content=content, tool_calls=calls,
                    finish_reason=finish, prompt_ids=prompt_ids, response_ids=response_ids,
                    logprobs=logprobs, logprobs_mode=slot.logprobs_mode or DEFAULT_LOGPROBS_MODE.get(
                        slot.dialect or Dialect.VLLM) if logprobs else None,
                    token_source="server" if response_ids is not None else "none",
                    message_count=len(request.messages),
                    format_error="tool_call" if malformed else ("length" if finish == "length" else None))


def _check_counts(slot: Slot, logprobs: list[float] | None, ids: list[int] | None, completion: Any) -> None:
    """One logprob per generated token, or none at all."""
    if logprobs is None:
        return
    tokens = len(ids) if ids is not None else (int(completion) if isinstance(completion, int) else None)
    if tokens is not None and tokens != len(logprobs):
        raise LogprobMismatch(f"{slot.address}: {len(logprobs)} logprobs for {tokens} generated tokens")
