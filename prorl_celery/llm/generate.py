"""``generate`` protocol: token in, token out. The chat template is applied here, with the model's
tokenizer; a continuation's prompt is the previous turn's prompt and response ids plus the new
messages' ids, so the history is never re-tokenised.

``POST /generate`` comes in two wire formats, the backend's ``dialect``:

- ``plain``: ``{"prompt_ids", sampling params}`` -> ``{"response_ids", "logprobs", "finish_reason"}``;
- ``sglang``: SGLang's native API, ``{"input_ids", "sampling_params": {"max_new_tokens", ...},
  "return_logprob": true}`` -> ``{"output_ids", "meta_info": {"output_token_logprobs": [[logprob,
  id, text], ...], "finish_reason": {"type": "stop" | "length" | "abort", ...}}}``.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol as TypingProtocol

from prorl_celery.errors import BackendFailed, ContextWindowExceeded, InvalidRequest
from prorl_celery.llm import chatml
from prorl_celery.llm.base import model_name, post, sampling_body
from prorl_celery.llm.models import Dialect, LLMRequest, Protocol, Turn
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


def max_new_tokens(slot: Slot, request: LLMRequest, prompt: list[int]) -> int | None:
    """The request's ``max_tokens``, clipped to the room the context window leaves the prompt."""
    limit = min(filter(None, [slot.max_model_len, request.max_model_len]), default=None)
    if limit is None:
        return request.sampling.max_tokens
    room = limit - len(prompt)
    if room <= 0:
        raise ContextWindowExceeded(f"the prompt has {len(prompt)} tokens; the context window is {limit}")
    return min(request.sampling.max_tokens or room, room)


class Generated(NamedTuple):
    response_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None


class Wire(TypingProtocol):
    """One dialect of ``POST /generate``: the request body, and the answer read back."""

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]: ...

    def answer(self, data: dict[str, Any]) -> Generated: ...


class FakeWire:
    """The project's fake server only (no real server has this API)."""

    path = "/generate"

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]:
        body = {**sampling_body(request), "prompt_ids": prompt, "model": model, "skip_special_tokens": False,
                "logprobs": True}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        return body

    def answer(self, data: dict[str, Any]) -> Generated:
        ids = data.get("response_ids", data.get("output_ids"))
        return Generated([int(i) for i in ids], _logprobs(data.get("logprobs")), data.get("finish_reason"))


class SGLangWire:
    path = "/generate"
    RENAMED = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed"}

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]:
        params = {self.RENAMED.get(k, k): v for k, v in sampling_body(request).items()}
        if max_tokens is not None:  # else SGLang's own default (128) applies
            params["max_new_tokens"] = max_tokens
        # stop at the template's end of turn even where the model's generation config has another EOS
        params.setdefault("stop_token_ids", sorted(tok.stop_ids))
        params.setdefault("skip_special_tokens", False)
        return {"input_ids": prompt, "sampling_params": params, "return_logprob": True}

    def answer(self, data: dict[str, Any]) -> Generated:
        meta = data.get("meta_info") or {}
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind == "abort":
            raise ValueError(f"the server aborted the request: {finish.get('message')}")
        triples = meta.get("output_token_logprobs")
        ids = data.get("output_ids")
        if ids is None:  # SGLang before output_ids: the ids come with the logprobs
            ids = [triple[1] for triple in triples]
        return Generated([int(i) for i in ids], _logprobs(triples), kind)


WIRES: dict[Dialect, Wire] = {Dialect.FAKE: FakeWire(), Dialect.SGLANG: SGLangWire()}


class GenerateClient:
    def generate(self, slot: Slot, request: LLMRequest, call: Call) -> Turn:
        model = model_name(slot, request)
        tok = get_tokenizer(request.tokenizer or slot.tokenizer or model)
        prompt = build_prompt(tok, request)
        max_tokens = max_new_tokens(slot, request, prompt)
        wire = WIRES[slot.dialect or Dialect.FAKE]
        data = post(slot, wire.path, wire.body(request, model, tok, prompt, max_tokens), call)
        try:
            out = wire.answer(data)
            if out.logprobs is not None and len(out.logprobs) != len(out.response_ids):
                raise ValueError(f"{len(out.logprobs)} logprobs for {len(out.response_ids)} tokens")
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise BackendFailed(f"{slot.address}/generate: unusable answer: {exc}") from None
        return self._turn(slot, request, model, tok, prompt, out, max_tokens)

    @staticmethod
    def _turn(slot: Slot, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
              out: Generated, max_tokens: int | None) -> Turn:
        response_ids = out.response_ids
        body = list(response_ids)
        while body and body[-1] in tok.stop_ids:
            body.pop()
        stopped = len(body) < len(response_ids)
        cut = not stopped and max_tokens is not None and len(response_ids) >= max_tokens
        finish = out.finish_reason or ("length" if cut else "stop")
        content, calls, malformed = chatml.split_tool_calls(tok.decode(body))
        return Turn(backend_id=slot.backend_id, address=slot.address, weight_version=slot.weight_version,
                    protocol=Protocol.GENERATE, model=model, content=content, tool_calls=calls,
                    finish_reason=finish, prompt_ids=prompt, response_ids=response_ids, logprobs=out.logprobs,
                    token_source="local", message_count=len(request.messages),
                    format_error="tool_call" if malformed else ("length" if finish == "length" else None))


def _logprobs(raw: Any) -> list[float] | None:
    """Floats, or SGLang's ``[logprob, id, text]`` triples, or ``{"logprob": x}`` dicts."""
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
