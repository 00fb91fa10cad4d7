"""``generate`` protocol: token in, token out. The chat template is applied here, with the model's
tokenizer; a continuation's prompt is the previous turn's prompt and response ids plus the new
messages' ids, so the history is never re-tokenised.

The backend's ``dialect`` names its token API (there is no default: real servers share none):
its token wire (:mod:`prorl_celery.llm.dialects`) builds the body and reads the answer, streamed
where the wire says so (llama.cpp's: a turn the service aborts keeps the tokens that came).

Every answer must carry one logprob per generated token (:class:`LogprobMismatch` otherwise).
"""
from __future__ import annotations

from typing import Any

from prorl_celery.errors import (BackendFailed, ContextWindowExceeded, InvalidRequest, LLMRequestRejected,
                                 LogprobMismatch, PartialAborted)
from prorl_celery.llm import dialects, tool_parsers
from prorl_celery.llm.clients.base import model_name, post, post_events
from prorl_celery.llm.dialects.base import Generated, TokenWire, aborted
from prorl_celery.llm.dialects.sampling import DEFAULT_MAX_TOKENS
from prorl_celery.llm.models import LLMRequest, PartialResponse, Protocol, Turn, WeightSegment, merge_segments
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.tokenizer import Tokenizer, continuation_ids, get_tokenizer, turn_closing_ids
from prorl_celery.llm.transport import Call, CallAborted


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


def max_new_tokens(slot: Slot, request: LLMRequest, prompt: list[int], margin: int = 0) -> int:
    """The request's ``max_tokens`` clipped to the room the context window leaves the prompt, less
    ``margin`` (SGLang refuses a request that would fill it exactly); without a ``max_tokens`` the
    room, and DEFAULT_MAX_TOKENS where no window is known: always a number, never a server's default."""
    limit = min(filter(None, [slot.backend.max_model_len, request.max_model_len]), default=None)
    if limit is None:
        return request.sampling.max_tokens or DEFAULT_MAX_TOKENS
    room = limit - len(prompt) - margin
    if room <= 0:
        raise ContextWindowExceeded(f"the prompt has {len(prompt)} tokens; the context window is {limit}"
                                    + (f" (this server needs {margin} token(s) of room)" if margin else ""))
    return min(request.sampling.max_tokens or room, room)


def wire_for(slot: Slot) -> TokenWire:
    """The backend's token wire (:func:`prorl_celery.llm.dialects.token_wire`), as it applies to
    the backend's address."""
    return dialects.token_wire(slot.backend.dialect, slot.backend.id).at(slot.backend.address)


class GenerateClient:
    def generate(self, slot: Slot, request: LLMRequest, call: Call) -> Turn:
        backend, model = slot.backend, model_name(slot, request)
        tok = get_tokenizer(request.tokenizer or backend.tokenizer or model)
        prompt = build_prompt(tok, request)
        partial = request.partial or PartialResponse()
        sent = prompt + partial.response_ids  # a continued turn: the server goes on from its own ids
        wire = wire_for(slot)
        max_tokens = max_new_tokens(slot, request, sent, wire.context_margin)
        if request.sampling.max_tokens and partial.response_ids:
            max_tokens = min(max_tokens, request.sampling.max_tokens - len(partial.response_ids))
        if max_tokens <= 0:  # the cut came at the turn's last token
            return self._turn(slot, request, model, tok, prompt, Generated([], [], "length"), 0,
                              backend.logprobs_mode or wire.logprobs_mode, partial)
        try:
            if wire.streamed:
                out = _streamed(slot, wire, _body(slot, wire, request, model, tok, sent, max_tokens), call)
            else:
                out = wire.answer(self._post(slot, wire, request, model, tok, sent, max_tokens, call))
        except PartialAborted as exc:
            raise PartialAborted(str(exc), _joined(slot, partial, exc.partial)) from None
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise BackendFailed(f"{backend.address}{wire.path}: unusable answer: {exc}") from None
        if out.logprobs is None or len(out.logprobs) != len(out.response_ids):
            got = "no" if out.logprobs is None else len(out.logprobs)
            raise LogprobMismatch(f"{backend.address}{wire.path}: {got} logprobs for {len(out.response_ids)} tokens")
        return self._turn(slot, request, model, tok, prompt, out, max_tokens,
                          backend.logprobs_mode or wire.logprobs_mode, partial)

    @staticmethod
    def _post(slot: Slot, wire: TokenWire, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
              max_tokens: int, call: Call) -> dict[str, Any]:
        try:
            return post(slot, wire.path, _body(slot, wire, request, model, tok, prompt, max_tokens), call)
        except LLMRequestRejected as exc:
            again = wire.after_refusal(slot.backend.address, exc)  # e.g. a field an older server lacks
            if again is None:
                raise
            return post(slot, again.path, _body(slot, again, request, model, tok, prompt, max_tokens), call)

    @staticmethod
    def _turn(slot: Slot, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
              out: Generated, max_tokens: int | None, logprobs_mode: str | None,
              partial: PartialResponse | None = None) -> Turn:
        partial = partial or PartialResponse()
        joined = _joined(slot, partial, out)
        response_ids = joined.response_ids
        body = list(response_ids)
        while body and body[-1] in tok.stop_ids:
            body.pop()
        stopped = len(body) < len(response_ids)
        cut = not stopped and max_tokens is not None and len(out.response_ids) >= max_tokens
        finish = out.finish_reason or ("length" if cut else "stop")
        content, calls, malformed = tool_parsers.split(slot.backend.tool_parser, tok.decode(body), request.tools)
        versions = list(dict.fromkeys(seg.version for seg in joined.segments))
        version = "+".join(v for v in versions if v) if len(versions) > 1 else (
            versions[0] if versions else out.weight_version or slot.backend.weight_version)
        return Turn(backend_id=slot.backend.id, address=slot.backend.address, weight_version=version,
                    protocol=Protocol.GENERATE, model=model, content=content, tool_calls=calls,
                    finish_reason=finish, prompt_ids=prompt, response_ids=response_ids, logprobs=joined.logprobs,
                    logprobs_mode=logprobs_mode, token_source="local", message_count=len(request.messages),
                    format_error="tool_call" if malformed else ("length" if finish == "length" else None),
                    weight_segments=joined.segments, continued=partial.continued, cached_tokens=out.served.cached_tokens,
                    # a continued turn's trace would cover only its last part: none rather than a part
                    routed_experts=None if partial.continued else out.served.routed_experts)


def _body(slot: Slot, wire: TokenWire, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
          max_tokens: int) -> dict[str, Any]:
    """``wire``'s body, asking for the routing trace where the backend was registered to give it."""
    body = wire.body(request, model, tok, prompt, max_tokens)
    if slot.backend.routed_experts:
        body.update(wire.routed_experts_request)
    return body


def fetch(slot: Slot, wire: TokenWire, body: dict[str, Any], call: Call) -> Generated:
    """What ``wire``'s server answers to ``body``: read as it streams where the wire streams."""
    if wire.streamed:
        return _streamed(slot, wire, body, call)
    return wire.answer(post(slot, wire.path, body, call))


def _streamed(slot: Slot, wire: TokenWire, body: dict[str, Any], call: Call) -> Generated:
    """The streamed turn; cut by the service's abort (the call's lease withdrawn: a pause in
    ``abort`` mode), the tokens that came, as the server's own abort of the turn would give them."""
    ids: list[int] = []
    logprobs: list[float] = []
    try:
        return wire.read_events(post_events(slot, wire.path, body, call), ids, logprobs)
    except CallAborted as exc:
        if exc.reason != "lost" or not ids:
            raise
        raise aborted(Generated(ids[:len(logprobs)], logprobs[:len(ids)], "abort"),
                      f"{slot.backend.address} (the service cut the stream)") from None


def _joined(slot: Slot, partial: PartialResponse, out: Generated) -> PartialResponse:
    """``partial`` followed by ``out``, each token with the version that sampled it: the server's
    spans where it reports them (vLLM's ``default`` and a missing version: the backend's
    registered one), else the whole answer the version of the backend it was asked of."""
    at, registered = len(partial.response_ids), slot.backend.weight_version
    spans = out.spans or [{"version": out.weight_version, "start": 0, "end": len(out.response_ids)}]
    segments = list(partial.segments)
    for span in spans:
        version = span.get("version")
        version = registered if version in (None, "default") else str(version)
        segments.append(WeightSegment(version=version, start=at + int(span["start"]), end=at + int(span["end"])))
    covered = max((seg.end for seg in segments), default=at)
    if covered < at + len(out.response_ids):  # spans short of the answer: the rest is the backend's
        segments.append(WeightSegment(version=registered, start=covered, end=at + len(out.response_ids)))
    return PartialResponse(response_ids=partial.response_ids + list(out.response_ids),
                           logprobs=partial.logprobs + list(out.logprobs or []),
                           segments=merge_segments(segments),
                           continued=partial.continued + (1 if out.finish_reason == "abort" else 0))
