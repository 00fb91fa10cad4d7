"""``chat`` protocol: OpenAI chat completions with tools, logprobs and (vLLM >= 0.10.2,
``return_token_ids``) the exact prompt and response token ids."""
from __future__ import annotations

from typing import Any

from prorl_celery.errors import BackendFailed
from prorl_celery.llm import chatml
from prorl_celery.llm.base import model_name, post, sampling_body
from prorl_celery.llm.models import LLMRequest, ToolCall, Turn
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.transport import Call


class ChatClient:
    def generate(self, slot: Slot, request: LLMRequest, call: Call) -> Turn:
        body: dict[str, Any] = {"model": model_name(slot, request), "messages": request.messages,
                                "logprobs": True, "return_token_ids": True, **sampling_body(request)}
        if request.tools:
            body["tools"] = request.tools
        if request.chat_template_kwargs:
            body["chat_template_kwargs"] = request.chat_template_kwargs
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
        prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
        finish = choice.get("finish_reason")
        return Turn(backend_id=slot.backend_id, address=slot.address, weight_version=slot.weight_version,
                    protocol=slot.protocol, model=model, content=content, tool_calls=calls,
                    finish_reason=finish, prompt_ids=prompt_ids, response_ids=response_ids,
                    logprobs=[float(e["logprob"]) for e in entries] or None,
                    token_source="server" if response_ids is not None else "none",
                    message_count=len(request.messages),
                    format_error="tool_call" if malformed else ("length" if finish == "length" else None))
