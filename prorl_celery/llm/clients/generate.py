"""``generate`` protocol: token in, token out. The chat template is applied here, with the model's
tokenizer; a continuation's prompt is the previous turn's prompt and response ids plus the new
messages' ids, so the history is never re-tokenised.

The backend's ``dialect`` names its token API (there is no default: real servers share none):

- ``llama.cpp``: ``POST /completion {"prompt": [ids], "n_predict", "n_probs": 1, "return_tokens",
  "stream": true}`` -> server-sent events, each ``{"tokens", "completion_probabilities": [{"id",
  "logprob"}, ...]}``, the last with ``"stop": true, "stop_type", "truncated"``. Streamed so that
  a turn the service aborts (a weight update's pause in ``abort`` mode: llama.cpp has no pause of
  its own) keeps the tokens that came, and goes on from them (abort-and-continue);
- ``sglang``: SGLang's native ``POST /generate {"input_ids", "sampling_params": {"max_new_tokens",
  ...}, "return_logprob": true}`` -> ``{"output_ids", "meta_info": {"output_token_logprobs": [[logprob,
  id, text], ...], "completion_tokens", "finish_reason": {"type": "stop" | "length" | "abort"}}}``;
  it refuses ``max_new_tokens >= context - len(prompt)`` (so the clip leaves one token), some
  versions put the prompt in front of ``output_ids`` (the last ``completion_tokens`` are taken,
  cross-checked with the logprobs' ids), older ones reject ``sampling_seed`` (resent without it),
  and ``abort`` (a weight update) is retried without quarantine;
- ``vllm-completions`` / ``vllm-generate``: vLLM's, in :mod:`prorl_celery.llm.dialects.vllm`;
- ``fake``: the project's fake server only, ``{"prompt_ids"}`` -> ``{"response_ids", "logprobs"}``.

Every answer must carry one logprob per generated token (:class:`LogprobMismatch` otherwise).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol as TypingProtocol

import threading

from prorl_celery.errors import (BackendAborted, BackendFailed, ContextWindowExceeded, InvalidRequest,
                                 LLMRequestRejected, LogprobMismatch, PartialAborted)
from prorl_celery.llm import chatml, tool_parsers
from prorl_celery.llm.clients.base import DEFAULT_MAX_TOKENS, model_name, post, post_events, sampling_body
from prorl_celery.llm.models import (Dialect, LLMRequest, PartialResponse, Protocol, Turn, WeightSegment,
                                     merge_segments)
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


class Generated(NamedTuple):
    response_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    weight_version: str | None = None
    spans: list[dict[str, Any]] | None = None  # vLLM's weight_versions: [{"version", "start", "end"}]


def aborted(out: Generated, server: str) -> BackendAborted:
    """The server's abort of a request (a weight update): PartialAborted carrying what it had
    generated (``partial`` is the :class:`Generated` read so far; the client adds the versions);
    a plain BackendAborted when the answer has no usable ids and logprobs."""
    if out.logprobs is None or len(out.logprobs) != len(out.response_ids):
        return BackendAborted(f"{server} aborted the request (no usable partial ids)")
    return PartialAborted(f"{server} aborted the request after {len(out.response_ids)} tokens", out)


class Wire(TypingProtocol):
    """One server's token API: where it is, the request body, and the answer read back."""

    path: str
    context_margin: int
    logprobs_mode: str | None

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]: ...

    def answer(self, data: dict[str, Any]) -> Generated: ...


class FakeWire:
    """The project's fake server only (no real server has this API)."""

    path = "/generate"
    context_margin = 0
    logprobs_mode = None

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]:
        return {**sampling_body(request, "fake", max_tokens), "prompt_ids": prompt, "model": model,
                "skip_special_tokens": False, "logprobs": True}

    def answer(self, data: dict[str, Any]) -> Generated:
        ids = data.get("response_ids", data.get("output_ids"))
        out = Generated([int(i) for i in ids], _logprobs(data.get("logprobs")), data.get("finish_reason"),
                        spans=data.get("weight_versions"))
        if out.finish_reason == "abort":
            raise aborted(out, "the fake server")
        return out


class LlamaCppWire:
    """llama.cpp's ``/completion`` with a token-id prompt; logprobs of the raw distribution
    (``post_sampling_probs`` false), the sampler chain fixed so that only the stated set applies."""

    path = "/completion"
    context_margin = 0
    logprobs_mode = "raw_logprobs"
    SAMPLERS = ["top_k", "top_p", "min_p", "temperature"]
    FINISH = {"eos": "stop", "word": "stop", "limit": "length"}

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]:
        params = sampling_body(request, "llama.cpp-completion", max_tokens)
        params.setdefault("stop", [])
        return {**params, "prompt": prompt, "n_probs": 1, "post_sampling_probs": False, "return_tokens": True,
                "cache_prompt": True, "samplers": self.SAMPLERS, "stream": True}

    def answer(self, data: dict[str, Any]) -> Generated:
        """One answer whole (a server that did not stream)."""
        return self.read_events(iter([data]), [], [])

    def read_events(self, events: Any, ids: list[int], logprobs: list[float]) -> Generated:
        """The streamed answer: ``ids`` and ``logprobs`` grow as the events come (the caller keeps
        them when the stream is cut); the Generated of the last event (``stop``)."""
        final: dict[str, Any] | None = None
        for event in events:  # read to the end, so the connection can be used again
            if "error" in event:
                raise BackendFailed(f"llama.cpp: {str(event['error'])[:300]}")
            if event.get("truncated"):
                raise ContextWindowExceeded("llama.cpp truncated the prompt to fit its context")
            got = [int(i) for i in event.get("tokens") or []]
            probs = event.get("completion_probabilities")
            if probs is not None and [int(p["id"]) for p in probs] != got:
                raise LogprobMismatch("llama.cpp: the logprobs' token ids are not the tokens it returned")
            if probs is None and got:
                raise LogprobMismatch(f"llama.cpp: no logprobs for {len(got)} tokens")
            ids.extend(got)
            logprobs.extend(_logprobs(probs) or [])
            if event.get("stop"):
                final = event
        if final is None:
            raise BackendFailed("llama.cpp: the stream ended before its last event")
        return Generated(list(ids), list(logprobs), self.FINISH.get(final.get("stop_type") or "", None))


class SGLangWire:
    path = "/generate"
    context_margin = 1  # SGLang: max_new_tokens >= context - len(prompt) is refused
    logprobs_mode = None

    def __init__(self, seed: bool = True):
        self.seed = seed

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]:
        params = sampling_body(request, "sglang", max_tokens)
        if not self.seed:
            params.pop("sampling_seed", None)
        # stop at the template's end of turn even where the model's generation config has another EOS
        params.setdefault("stop_token_ids", sorted(tok.stop_ids))
        params.setdefault("skip_special_tokens", False)
        return {"input_ids": prompt, "sampling_params": params, "return_logprob": True}

    def answer(self, data: dict[str, Any]) -> Generated:
        meta = data.get("meta_info") or {}
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        triples = meta.get("output_token_logprobs")
        if kind == "abort":
            message = finish.get("message") if isinstance(finish, dict) else None
            ids = [int(t[1]) for t in triples or []] or [int(i) for i in data.get("output_ids") or []]
            if not ids:
                raise BackendAborted(f"SGLang aborted the request: {message}")
            count = meta.get("completion_tokens")
            ids = ids[len(ids) - count:] if isinstance(count, int) and len(ids) > count else ids
            raise aborted(Generated(ids, _logprobs(triples), "abort"), f"SGLang ({message})")
        from_logprobs = [int(t[1]) for t in triples] if triples is not None else None
        ids = data.get("output_ids")
        if ids is None:  # SGLang before output_ids: the ids come with the logprobs
            ids = from_logprobs
        else:
            ids = [int(i) for i in ids]
            count = meta.get("completion_tokens")
            if isinstance(count, int) and len(ids) > count:  # versions that prefix the prompt
                ids = ids[len(ids) - count:]
        if ids is None:
            raise BackendFailed("SGLang answered neither output_ids nor output_token_logprobs")
        if from_logprobs is not None and from_logprobs != ids:
            raise LogprobMismatch(f"SGLang: output_ids ({len(ids)}) and the logprobs' ids "
                                  f"({len(from_logprobs)}) disagree")
        return Generated(ids, _logprobs(triples), kind)


WIRES: dict[Dialect, Wire] = {Dialect.FAKE: FakeWire(), Dialect.SGLANG: SGLangWire(),
                              Dialect.LLAMACPP: LlamaCppWire()}
_SGLANG_NO_SEED = SGLangWire(seed=False)
_no_seed: set[str] = set()  # SGLang addresses that rejected sampling_seed
_wires_lock = threading.Lock()


def wire_for(slot: Slot) -> Wire:
    """The backend's wire; vLLM's live in :mod:`prorl_celery.llm.dialects.vllm`, imported on first use."""
    dialect = slot.backend.dialect
    if dialect is None:
        raise LLMRequestRejected(f"backend {slot.backend.id} has no dialect: register it with the server's "
                                 "token API (llama.cpp, sglang, vllm-completions, vllm-generate)")
    if dialect is Dialect.SGLANG and slot.backend.address in _no_seed:
        return _SGLANG_NO_SEED
    with _wires_lock:
        if dialect in (Dialect.VLLM_COMPLETIONS, Dialect.VLLM_GENERATE) and dialect not in WIRES:
            try:
                from prorl_celery.llm.dialects import vllm
            except ImportError as exc:
                raise LLMRequestRejected(f"dialect {dialect.value} is not available here: {exc}") from None
            WIRES[Dialect.VLLM_COMPLETIONS] = vllm.VllmCompletionsWire()
            WIRES[Dialect.VLLM_GENERATE] = vllm.VllmGenerateWire()
    if dialect not in WIRES:
        raise LLMRequestRejected(f"dialect {dialect.value} is not a token API")
    return WIRES[dialect]


class GenerateClient:
    def generate(self, slot: Slot, request: LLMRequest, call: Call) -> Turn:
        backend, model = slot.backend, model_name(slot, request)
        tok = get_tokenizer(request.tokenizer or backend.tokenizer or model)
        prompt = build_prompt(tok, request)
        partial = request.partial or PartialResponse()
        sent = prompt + partial.response_ids  # a continued turn: the server goes on from its own ids
        wire = wire_for(slot)
        max_tokens = max_new_tokens(slot, request, sent, getattr(wire, "context_margin", 0))
        if request.sampling.max_tokens and partial.response_ids:
            max_tokens = min(max_tokens, request.sampling.max_tokens - len(partial.response_ids))
        if max_tokens <= 0:  # the cut came at the turn's last token
            return self._turn(slot, request, model, tok, prompt, Generated([], [], "length"), 0,
                              backend.logprobs_mode or getattr(wire, "logprobs_mode", None), partial)
        try:
            if isinstance(wire, LlamaCppWire):
                out = _streamed(slot, wire, wire.body(request, model, tok, sent, max_tokens), call)
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
                          backend.logprobs_mode or getattr(wire, "logprobs_mode", None), partial)

    @staticmethod
    def _post(slot: Slot, wire: Wire, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
              max_tokens: int, call: Call) -> dict[str, Any]:
        try:
            return post(slot, wire.path, wire.body(request, model, tok, prompt, max_tokens), call)
        except LLMRequestRejected as exc:
            if slot.backend.dialect is not Dialect.SGLANG or "sampling_seed" not in str(exc) or wire is _SGLANG_NO_SEED:
                raise
            _no_seed.add(slot.backend.address)  # an SGLang without seeded sampling: the same request, unseeded
            return post(slot, _SGLANG_NO_SEED.path, _SGLANG_NO_SEED.body(request, model, tok, prompt, max_tokens),
                        call)

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
                    weight_segments=joined.segments, continued=partial.continued)


def fetch(slot: Slot, wire: Wire, body: dict[str, Any], call: Call) -> Generated:
    """What ``wire``'s server answers to ``body``: read as it streams where the wire streams."""
    if isinstance(wire, LlamaCppWire):
        return _streamed(slot, wire, body, call)
    return wire.answer(post(slot, wire.path, body, call))


def _streamed(slot: Slot, wire: LlamaCppWire, body: dict[str, Any], call: Call) -> Generated:
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
