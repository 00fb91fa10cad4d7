"""``generate`` protocol: token in, token out (``{"prompt_ids", sampling params}`` ->
``{"response_ids", "logprobs"}``). The chat template is applied here, with the model's tokenizer;
a continuation's prompt is the previous turn's prompt and response ids plus the new messages'
ids, so the history is never re-tokenised."""
from __future__ import annotations

from typing import Any

from prorl_celery.errors import BackendFailed, ContextWindowExceeded, InvalidRequest
from prorl_celery.llm import chatml
from prorl_celery.llm.base import model_name, post, sampling_body
from prorl_celery.llm.models import LLMRequest, Protocol, Turn
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.tokenizer import Tokenizer, continuation_ids, get_tokenizer, turn_closing_ids
from prorl_celery.llm.transport import Call


def build_prompt(tok: Tokenizer, request: LLMRequest) -> list[int]:
    """The prompt ids of ``request``: appended to the previous turn's ids when there is one."""
    kwargs = request.chat_template_kwargs or {}
    prev = request.previous
    if prev is None or prev.protocol is not Protocol.GENERATE or prev.prompt_ids is None \
            or prev.response_ids is None:
        return tok.apply_chat_template(request.messages, tools=request.tools, add_generation_prompt=True,
                                       **kwargs)
    own = request.messages[prev.message_count:prev.message_count + 1]
    if not own or own[0].get("role") != "assistant":
        raise InvalidRequest("messages must continue the previous turn: its assistant message at index "
                             f"{prev.message_count}", field="messages")
    new = request.messages[prev.message_count + 1:]
    return (prev.prompt_ids + prev.response_ids + turn_closing_ids(tok, prev.response_ids, request.tools, **kwargs)
            + continuation_ids(tok, new, request.tools, **kwargs))


class GenerateClient:
    def generate(self, slot: Slot, request: LLMRequest, call: Call) -> Turn:
        model = model_name(slot, request)
        tok = get_tokenizer(request.tokenizer or slot.tokenizer or model)
        prompt = build_prompt(tok, request)
        body: dict[str, Any] = {**sampling_body(request), "prompt_ids": prompt, "model": model,
                                "skip_special_tokens": False, "logprobs": True}
        limit = min(filter(None, [slot.max_model_len, request.max_model_len]), default=None)
        if limit is not None:
            room = limit - len(prompt)
            if room <= 0:
                raise ContextWindowExceeded(f"the prompt has {len(prompt)} tokens; the context window "
                                            f"is {limit}")
            body["max_tokens"] = min(body.get("max_tokens") or room, room)
        data = post(slot, "/generate", body, call)
        try:
            response_ids = [int(i) for i in data.get("response_ids", data.get("output_ids"))]
            logprobs = _logprobs(data.get("logprobs"))
        except (TypeError, ValueError) as exc:
            raise BackendFailed(f"{slot.address}: malformed /generate answer: {exc!r}") from None
        return self._turn(slot, request, model, tok, prompt, response_ids, logprobs,
                          data.get("finish_reason"), body.get("max_tokens"))

    @staticmethod
    def _turn(slot: Slot, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
              response_ids: list[int], logprobs: list[float] | None, finish: str | None,
              max_tokens: int | None) -> Turn:
        body = list(response_ids)
        while body and body[-1] in tok.stop_ids:
            body.pop()
        stopped = len(body) < len(response_ids)
        finish = finish or ("stop" if stopped or max_tokens is None or len(response_ids) < max_tokens
                            else "length")
        content, calls, malformed = chatml.split_tool_calls(tok.decode(body))
        return Turn(backend_id=slot.backend_id, address=slot.address, weight_version=slot.weight_version,
                    protocol=Protocol.GENERATE, model=model, content=content, tool_calls=calls,
                    finish_reason=finish, prompt_ids=prompt, response_ids=response_ids, logprobs=logprobs,
                    token_source="local", message_count=len(request.messages),
                    format_error="tool_call" if malformed else ("length" if finish == "length" else None))


def _logprobs(raw: Any) -> list[float] | None:
    """Floats, or SGLang-style ``[logprob, id, text]`` triples, or ``{"logprob": x}`` dicts."""
    if raw is None:
        return None
    out = []
    for item in raw:
        if isinstance(item, dict):
            out.append(float(item["logprob"]))
        elif isinstance(item, (list, tuple)):
            out.append(float(item[0]))
        else:
            out.append(float(item))
    return out
