"""llama.cpp's server, chat and token API both as dialect ``llama.cpp``. It has no pause of its own:
its token API is read streamed, so a weight update's pause in ``abort`` mode cuts the stream and
the turn goes on from the tokens that came (abort-and-continue).

- chat: ``repeat_penalty``, top_k 0 = off, a fixed sampler chain, logprobs of the raw distribution
  (``post_sampling_probs`` false); each logprob entry carries its token ``id``, so the response
  ids are exact (the prompt ids are not reported). ``tool_choice`` ``required`` or a named function
  goes as a GBNF grammar for one Hermes call with ``tool_choice: none`` (llama.cpp lets the model
  talk before the call under ``required``; see :mod:`.llamacpp_tools`), and the call is read from
  the text.
- generate: ``POST /completion {"prompt": [ids], "n_predict", "n_probs": 1, "return_tokens",
  "stream": true}`` -> server-sent events, each ``{"tokens", "completion_probabilities": [{"id",
  "logprob"}, ...]}``, the last with ``"stop": true, "stop_type", "truncated"``.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prorl_celery.errors import BackendFailed, ContextWindowExceeded, LogprobMismatch
from prorl_celery.llm.dialects.base import Dialect, Generated, TokenWire, read_logprobs
from prorl_celery.llm.dialects.chat_wire import ChatWire
from prorl_celery.llm.dialects.llamacpp_tools import forced_call
from prorl_celery.llm.dialects.sampling import Sampling
from prorl_celery.llm.models import LLMRequest
from prorl_celery.llm.tokenizer import Tokenizer

RAW = "raw_logprobs"
SAMPLERS = ["top_k", "top_p", "min_p", "temperature"]  # only the stated set applies


class LlamaCppChat(ChatWire):
    sampling = Sampling(names={"repetition_penalty": "repeat_penalty"}, top_k_off=0)
    logprobs_mode = RAW

    def extra(self, body: dict[str, Any], request: LLMRequest) -> None:
        body["samplers"] = SAMPLERS
        body["post_sampling_probs"] = False
        body.update(forced_call(request.tools, body.get("tool_choice")))  # required: a grammar, not the flag


class LlamaCppWire(TokenWire):
    """llama.cpp's ``/completion`` with a token-id prompt; logprobs of the raw distribution
    (``post_sampling_probs`` false), the sampler chain fixed so that only the stated set applies."""

    path = "/completion"
    sampling = Sampling(names={"repetition_penalty": "repeat_penalty", "max_tokens": "n_predict"}, top_k_off=0)
    logprobs_mode = RAW
    streamed = True
    FINISH = {"eos": "stop", "word": "stop", "limit": "length"}

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]:
        params = self.sampling.body(request, max_tokens)
        params.setdefault("stop", [])
        return {**params, "prompt": prompt, "n_probs": 1, "post_sampling_probs": False, "return_tokens": True,
                "cache_prompt": True, "samplers": SAMPLERS, "stream": True}

    def answer(self, data: dict[str, Any]) -> Generated:
        """One answer whole (a server that did not stream)."""
        return self.read_events(iter([data]), [], [])

    def read_events(self, events: Iterator[dict[str, Any]], ids: list[int], logprobs: list[float]) -> Generated:
        """The streamed answer: ``ids`` and ``logprobs`` grow as the events come (the caller keeps
        them when the stream is cut); the Generated of the last event (``stop``)."""
        final: dict[str, Any] | None = None
        for event in events:  # read to the end, so the connection can be used again
            got, probs = _event_tokens(event)
            ids.extend(got)
            logprobs.extend(read_logprobs(probs) or [])
            if event.get("stop"):
                final = event
        if final is None:
            raise BackendFailed("llama.cpp: the stream ended before its last event")
        return Generated(list(ids), list(logprobs), self.FINISH.get(final.get("stop_type") or "", None))


def _event_tokens(event: dict[str, Any]) -> tuple[list[int], Any]:
    """(the token ids of one streamed event, their ``completion_probabilities``); an error event,
    a truncated prompt or logprobs that do not match the tokens raise."""
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
    return got, probs


class LlamaCpp(Dialect):
    name = "llama.cpp"
    server = "llama.cpp"
    chat = LlamaCppChat()
    token = LlamaCppWire()
    probe_hints = {"tools": "--jinja (and a chat template with tool calls, e.g. --chat-template-file)"}
