"""The fake LLM server's token-in/token-out endpoints, one per real server's API (test and demo
tool; see :mod:`prorl_celery.fakes.llm.server`):

- vLLM ``POST /v1/completions`` with a token-id ``prompt``: ``max_tokens`` defaults to 16,
  ``logprobs`` (an int) gives OpenAI's ``{"tokens", "token_logprobs", ...}``, ``return_token_ids``
  gives ``choices[0].token_ids`` and ``prompt_token_ids``;
- vLLM ``POST /inference/v1/generate``: ``{"token_ids", "sampling_params"}`` ->
  ``choices[0].token_ids`` and chat-style ``logprobs.content``;
- llama.cpp ``POST /completion`` with a token-id ``prompt``: ``n_predict``, ``n_probs`` ->
  ``tokens`` (with ``return_tokens``), ``completion_probabilities``, ``stop_type``;
- SGLang ``POST /generate`` with ``input_ids``: ``meta_info.output_token_logprobs`` triples and
  ``finish_reason.type`` stop | length | abort (fault ``abort_next``: a weight update), its ``>=``
  context check, and with ``--sglang-prompt-in-output`` the prompt ids before ``output_ids`` (as
  some versions do);
- ``POST /generate`` with ``prompt_ids``: the ``fake`` dialect, this server's own test-only shape
  (``weight_versions`` spans as vLLM's generate endpoint reports them).

A request cut by a pause in abort mode (:mod:`prorl_celery.fakes.llm.pause_api`) answers with the
tokens generated so far and the server's abort finish reason (vLLM ``"abort"``, SGLang ``{"type":
"abort"}``).
"""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from prorl_celery.llm import chatml

from prorl_celery.fakes.llm import llamacpp as fake_llamacpp
from prorl_celery.fakes.llm import served as fake_served
from prorl_celery.fakes.llm.wire import (FINGERPRINT, HTTPError, check_max_tokens, llamacpp_error,
                                         llamacpp_max_tokens, llamacpp_probs, sglang_error, timings, vllm_error,
                                         vllm_max_tokens, vllm_usage)

if TYPE_CHECKING:
    from prorl_celery.fakes.llm.state import FakeLLM

SGLANG_MAX_NEW_TOKENS = 128  # SGLang's default when a request names none
VLLM_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest / SamplingParams default


_ID_TYPES = frozenset({int, bool})  # what isinstance(i, int) admits


def _ids(value: Any, name: str, error) -> list[int]:
    # the types and the least id in C (map, set, min): a per-id check in Python cost 100 us on a
    # 1,500-id prompt, on every token-mode call
    if not isinstance(value, list) or not value or not (set(map(type, value)) <= _ID_TYPES and min(value) >= 0):
        raise error(400, f"{name}: a non-empty list of token ids is required")
    return value


def _run(fake: FakeLLM, prompt: list[int], max_tokens: int, endpoint: str, sock, params: dict[str, Any],
         **extra: Any) -> dict[str, Any] | None:
    messages = chatml.parse(fake.tok.decode(prompt))
    return fake.generate(messages, None, prompt, max_tokens, endpoint, sock, ignore_eos=bool(params.get("ignore_eos")),
                         min_tokens=int(params.get("min_tokens") or 0), seeded=params.get("seed") is not None,
                         **extra)


def _text(fake: FakeLLM, ids: list[int]) -> str:
    return fake.tok.decode([i for i in ids if i not in fake.tok.stop_ids])


def vllm_completions(fake: FakeLLM, body: dict[str, Any], sock) -> dict[str, Any] | None:
    """``/v1/completions``: vLLM's (``--flavor vllm``) or llama.cpp's OpenAI-compatible one."""
    llamacpp = fake.options.flavor == "llama.cpp"
    prompt = body.get("prompt")
    error = llamacpp_error if llamacpp else vllm_error
    prompt = fake.tok.encode(prompt) if isinstance(prompt, str) and prompt else _ids(prompt, "prompt", error)
    if llamacpp:
        max_tokens = llamacpp_max_tokens(fake, prompt, body.get("max_tokens"))
    else:
        check_max_tokens(body.get("max_tokens"), fake.max_model_len)
        max_tokens = vllm_max_tokens(fake, prompt, body.get("max_tokens"), VLLM_DEFAULT_MAX_TOKENS)
    entry = _run(fake, prompt, max_tokens, "vllm-completions", sock, body)
    if entry is None:
        return None
    ids = entry["response_ids"]
    if llamacpp:
        probs = llamacpp_probs(fake, ids, int(body["logprobs"])) if body.get("logprobs") is not None else None
        return fake_llamacpp.oai_completion(fake, body, prompt, entry, _text(fake, ids), probs, timings(prompt, ids))
    logprobs = None
    if body.get("logprobs") is not None:
        texts = [fake.tok.decode([t]) for t in ids]
        offsets = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
        tokens = [f"token_id:{t}" for t in ids] if body.get("return_tokens_as_token_ids") else texts
        lps = fake.logprobs(ids)
        top = [{tok: lp} for tok, lp in zip(tokens, lps)]  # the sampled token's, even with logprobs=0
        logprobs = {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": top}
    want_ids = bool(body.get("return_token_ids"))
    choice = {"index": 0, "text": _text(fake, ids), "logprobs": logprobs, "finish_reason": entry["finish_reason"],
              "stop_reason": None, "token_ids": ids if want_ids else None,
              "prompt_logprobs": prompt_logprobs(fake, prompt) if body.get("prompt_logprobs") is not None else None,
              "prompt_token_ids": prompt if want_ids else None, "routed_experts": entry.get("routed_experts")}
    return {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or fake.model, "choices": [choice], "service_tier": None,
            "system_fingerprint": FINGERPRINT, "usage": vllm_usage(prompt, ids, fake, entry), "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None}


def prompt_logprobs(fake: FakeLLM, prompt: list[int]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: none for the first token, then ``{id: {logprob, rank, decoded_token}}``."""
    lps = fake.logprobs(prompt)
    return [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": fake.tok.decode([t])}}
                     for t, lp in zip(prompt[1:], lps[1:])]


def vllm_generate(fake: FakeLLM, body: dict[str, Any], sock) -> dict[str, Any] | None:
    """vLLM's ``/inference/v1/generate`` as 0.32 answers it (``--enable-scale-out``): unknown
    sampling params ignored, the window checked with its own message, ``weight_versions`` spans."""
    prompt = _ids(body.get("token_ids"), "token_ids", vllm_error)
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise vllm_error(400, "sampling_params: an object is required", param="sampling_params")
    limit = fake.max_model_len
    if len(prompt) > limit:
        raise vllm_error(400, f"The decoder prompt (length {len(prompt)}) is longer than the maximum model length "
                              f"of {limit}. Make sure that `max_model_len` is no smaller than the number of text "
                              "tokens.")
    check_max_tokens(params.get("max_tokens"), limit)
    max_tokens = min(params.get("max_tokens") or VLLM_DEFAULT_MAX_TOKENS, limit - len(prompt))
    entry = _run(fake, prompt, max_tokens, "vllm-generate", sock, params, sampling_params=params)
    if entry is None:
        return None
    ids = entry["response_ids"]
    logprobs = None
    if params.get("logprobs") is not None:
        top = int(params["logprobs"]) or 1
        entries = [{"token_id": t, "logprob": lp, "rank": 1} for t, lp in zip(ids, fake.logprobs(ids))]
        logprobs = {"content": [{**e, "top_logprobs": [dict(e) for _ in range(top)]} for e in entries]}
    choice = {"index": 0, "finish_reason": entry["finish_reason"], "stop_reason": None, "token_ids": ids,
              "routed_experts": entry.get("routed_experts"), "sampling_mask": None,
              "weight_versions": entry["weight_versions"],
              "logprobs": logprobs}
    return {"request_id": body.get("request_id") or f"generate-tokens-{uuid.uuid4().hex[:16]}",
            "model": body.get("model") or fake.model, "created": int(time.time()), "usage": vllm_usage(prompt, ids, fake, entry),
            "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "output_mode": "tokens", "choices": [choice]}


def llamacpp_completion(fake: FakeLLM, body: dict[str, Any], sock) -> dict[str, Any] | None:
    prompt = body.get("prompt")
    prompt = fake.tok.encode(prompt) if isinstance(prompt, str) and prompt else _ids(prompt, "prompt", llamacpp_error)
    n_predict = body.get("n_predict", body.get("max_tokens"))
    max_tokens = llamacpp_max_tokens(fake, prompt, n_predict)
    entry = _run(fake, prompt, max_tokens, "llama.cpp", sock, body)
    if entry is None:
        return None
    ids = entry["response_ids"]
    eos = bool(ids) and ids[-1] in fake.tok.stop_ids
    stop_type = "eos" if eos else "limit"
    out: dict[str, Any] = {
        "index": 0, "content": _text(fake, ids), "tokens": ids if body.get("return_tokens") else [],
        "id_slot": 0, "stop": True, "model": body.get("model") or fake.model, "tokens_predicted": len(ids),
        "tokens_evaluated": len(prompt), "generation_settings": fake_llamacpp.generation_settings(body),
        "prompt": fake.tok.decode(prompt), "has_new_line": "\n" in _text(fake, ids), "truncated": False,
        "stop_type": stop_type, "stopping_word": "", "tokens_cached": len(prompt) + len(ids),
        "timings": timings(prompt, ids)}
    if body.get("n_probs"):
        out["completion_probabilities"] = llamacpp_probs(fake, ids, int(body["n_probs"]))
    if body.get("stream"):  # as llama.cpp: an event a token, then the last one with the totals
        return EventStream(_llamacpp_events(out))
    return out


class EventStream(list):
    """Server-sent events to answer with (``data: <json>`` each), instead of one JSON body."""


def _llamacpp_events(whole: dict[str, Any]) -> list[dict[str, Any]]:
    probs = whole.get("completion_probabilities")
    tokens = whole["tokens"]
    events = [{"index": 0, "content": "", "tokens": [t] if tokens else [], "stop": False, "id_slot": -1,
               "tokens_predicted": k + 1, "tokens_evaluated": whole["tokens_evaluated"],
               **({"completion_probabilities": [probs[k]]} if probs is not None else {})}
              for k, t in enumerate(tokens)]
    last = {key: value for key, value in whole.items() if key != "completion_probabilities"}
    return events + [{**last, "content": "", "tokens": []}]


def sglang_generate(fake: FakeLLM, body: dict[str, Any], sock) -> dict[str, Any] | None:
    """SGLang's native ``/generate`` for one prompt of ``input_ids`` (no streaming, no batches)."""
    prompt = _ids(body.get("input_ids"), "input_ids", sglang_error)
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise sglang_error(400, "sampling_params: an object is required")
    if "sampling_seed" in sampling and not fake.options.sglang_seed:
        raise sglang_error(400, "SamplingParams.__init__() got an unexpected keyword argument 'sampling_seed'")
    limit = fake.max_model_len
    if len(prompt) >= limit:
        raise sglang_error(400, f"The input ({len(prompt)} tokens) is longer than the model's context length "
                                f"({limit} tokens).")
    asked = sampling.get("max_new_tokens")
    if asked is not None and asked + len(prompt) >= limit:  # SGLang's own check is >=: the last slot stays free
        raise sglang_error(400, f"Requested token count exceeds the model's maximum context length of {limit} "
                                f"tokens. You requested a total of {asked + len(prompt)} tokens: {len(prompt)} "
                                f"tokens from the input messages and {asked} tokens for the completion. Please "
                                "reduce the number of tokens in the input messages or the completion to fit "
                                "within the limit.")
    max_tokens = asked if asked is not None else min(SGLANG_MAX_NEW_TOKENS, limit - len(prompt) - 1)
    params = {"min_tokens": sampling.get("min_new_tokens"), "ignore_eos": sampling.get("ignore_eos")}
    started = time.time()
    entry = _run(fake, prompt, max_tokens, "sglang", sock, params, sampling_params=sampling)
    if entry is None:
        return None
    ids = entry["response_ids"]
    if fake.take_abort():
        ids, finish = [], {"type": "abort", "message": "Abort before weight update.", "status_code": 503}
    elif entry["finish_reason"] == "abort":  # pause_generation in abort mode: the tokens so far come back
        finish = {"type": "abort", "message": "Abort in pause_generation.", "status_code": 503}
    elif entry["finish_reason"] == "stop" and ids and ids[-1] in fake.tok.stop_ids:
        finish = {"type": "stop", "matched": ids[-1]}
    else:
        finish = {"type": "length", "length": len(ids)}
    meta: dict[str, Any] = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(prompt),
                            "weight_version": fake.engine.version, "completion_tokens": len(ids),
                            "cached_tokens": entry.get("cached_tokens", 0), "e2e_latency": time.time() - started}
    if body.get("return_routed_experts") and entry.get("routed_experts") is not None:
        meta["routed_experts"] = fake_served.packed(entry["routed_experts"])
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, fake.logprobs(ids))]
    text = fake.tok.decode(ids[:-1] if finish["type"] == "stop" else ids)  # the matched stop token is trimmed
    output_ids = (prompt + ids) if fake.options.sglang_prompt_in_output else ids
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


def fake_generate(fake: FakeLLM, body: dict[str, Any], sock) -> dict[str, Any] | None:
    """The ``fake`` dialect: no real server has it; for the project's own tests only."""
    prompt = _ids(body.get("prompt_ids"), "prompt_ids", lambda s, m: HTTPError(s, m))
    limit = fake.max_model_len
    asked = body.get("max_tokens")
    if len(prompt) + (asked or 1) > limit:
        raise HTTPError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{len(prompt) + (asked or 1)} tokens.")
    entry = _run(fake, prompt, asked or limit - len(prompt), "generate", sock, body)
    if entry is None:
        return None
    ids = entry["response_ids"]
    return {"response_ids": ids, "logprobs": fake.logprobs(ids), "finish_reason": entry["finish_reason"],
            "text": fake.tok.decode(ids), "weight_versions": entry["weight_versions"]}


def generate(fake: FakeLLM, body: dict[str, Any], sock) -> dict[str, Any] | None:
    """``POST /generate``: SGLang's API when the body has ``input_ids``, else the ``fake`` dialect."""
    return (sglang_generate if "input_ids" in body else fake_generate)(fake, body, sock)


ROUTES = {"/v1/completions": vllm_completions, "/inference/v1/generate": vllm_generate,
          "/completion": llamacpp_completion, "/completions": llamacpp_completion, "/generate": generate}
