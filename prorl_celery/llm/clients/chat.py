"""``chat`` protocol: OpenAI chat completions with tools and logprobs, in the backend's dialect
(:mod:`prorl_celery.llm.dialects`; ``vllm`` when it names none): the dialect's chat wire builds the
body and reads the answer (:mod:`prorl_celery.llm.dialects.chat_wire`), this client posts it and
makes the turn.

A logprob count other than the response's token count is a :class:`LogprobMismatch` (retried
on another backend), never padded.
"""
from __future__ import annotations

from typing import Any

from prorl_celery.errors import BackendFailed, LogprobMismatch
from prorl_celery.llm import dialects
from prorl_celery.llm.clients.base import model_name, post
from prorl_celery.llm.models import LLMRequest, Turn
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.transport import Call


def chat_body(slot: Slot, request: LLMRequest, model: str, max_tokens: int | None = None) -> dict[str, Any]:
    """The request body in the backend's dialect (also used by the registration probe)."""
    return dialects.chat_wire(slot.backend.dialect).body(request, model, max_tokens)


class ChatClient:
    def generate(self, slot: Slot, request: LLMRequest, call: Call) -> Turn:
        wire = dialects.chat_wire(slot.backend.dialect)
        body = wire.body(request, model_name(slot, request))
        data = post(slot, wire.path, body, call)
        try:
            return self._turn(slot, request, body["model"], data)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise BackendFailed(f"{slot.backend.address}: malformed chat completion: {exc!r}") from None

    @staticmethod
    def _turn(slot: Slot, request: LLMRequest, model: str, data: dict[str, Any]) -> Turn:
        backend = slot.backend
        wire = dialects.chat_wire(backend.dialect)
        got = wire.answer(data, request, backend.tool_parser)
        usage = data.get("usage") or {}
        _check_counts(slot, got.logprobs, got.response_ids, usage.get("completion_tokens"))
        finish = got.finish_reason
        return Turn(backend_id=backend.id, address=backend.address, weight_version=backend.weight_version,
                    protocol=backend.protocol, model=model, content=got.content, tool_calls=got.tool_calls,
                    finish_reason=finish, prompt_ids=got.prompt_ids, response_ids=got.response_ids,
                    logprobs=got.logprobs,
                    logprobs_mode=(backend.logprobs_mode or wire.logprobs_mode) if got.logprobs else None,
                    token_source="server" if got.response_ids is not None else "none",
                    message_count=len(request.messages), cached_tokens=got.served.cached_tokens,
                    routed_experts=got.served.routed_experts,
                    format_error="tool_call" if got.malformed else ("length" if finish == "length" else None))


def _check_counts(slot: Slot, logprobs: list[float] | None, ids: list[int] | None, completion: Any) -> None:
    """One logprob per generated token, or none at all."""
    if logprobs is None:
        return
    tokens = len(ids) if ids is not None else (int(completion) if isinstance(completion, int) else None)
    if tokens is not None and tokens != len(logprobs):
        raise LogprobMismatch(f"{slot.backend.address}: {len(logprobs)} logprobs for {tokens} generated tokens")
