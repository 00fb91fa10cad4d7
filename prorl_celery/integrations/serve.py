"""Serve a trainer's live model as a ``generate`` backend, for CPU and small runs (a real GPU run
registers its vLLM instead): a small HTTP server in the trainer's process (Flask on waitress,
:mod:`prorl_celery.integrations.live_app`) that speaks two of
vLLM's token APIs — ``POST /inference/v1/generate`` (the ``vllm-generate`` dialect, registered by
default: its answers say which weight version sampled each span of tokens) and ``POST
/v1/completions`` with a token-id prompt (``vllm-completions``) — and vLLM's pause API, so the
service can freeze rollouts in place around each optimizer step (``pause_api: "vllm"``):

- ``POST /pause?mode=keep|abort|wait`` -> ``{"status": "paused"}`` once the weights may be
  written; ``POST /resume``; ``GET /is_paused``; ``POST /update_weight_version {"new_version"}``
  and ``GET /weight_info``: the name the next tokens carry.

Sampling is :class:`prorl_celery.integrations.live_engine.LiveEngine`: requests that arrive
together (a group's n rollouts) are prefilled as one batch and requests that arrive later join
the running rows between decode steps, from the very weights the trainer is updating, with each
sampled id's logprob of the model's raw distribution (vLLM's default ``raw_logprobs``). Sampling
fields it cannot honour (stop strings, ``n > 1``, penalties other than repetition, streaming)
and values outside what it computes safely (:mod:`prorl_celery.integrations.live_schemas`) are
refused with a 400 naming the field, never ignored; a row that still fails ends alone, and a call
generates at most :attr:`LiveModelServer.max_tokens` tokens.

    server = LiveModelServer(model, tokenizer).start()
    server.register(client, tokenizer=model_dir)     # POST /llm_servers, probed; pause_api vllm
    ...
    client.pause("keep"); optimizer.step(); client.resume(weight_version="step1")
"""
from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable
from typing import Any

from config.settings import get_settings

from prorl_celery.integrations.live_app import ThreadedServer, create_app
from prorl_celery.integrations.live_engine import LiveEngine, Row, RowParams
from prorl_celery.integrations.live_schemas import CompletionRequest, GenerateRequest, Sampling

__all__ = ["CompletionRequest", "GenerateRequest", "LiveModelServer"]

MAX_BODY_BYTES = 16 * 2**20  # a prompt of 1M token ids is ~8 MB of JSON


class LiveModelServer:
    """The trainer's own model object, served: an optimizer step changes what the next decode
    step samples from. Write weights only while paused (``POST /pause``, i.e. the service's
    ``client.pause("keep")``) or while holding :attr:`lock` (held for every forward pass).

    ``max_tokens`` caps what one call generates (default: the ``live_max_tokens`` setting); a call
    asking more (a call without ``max_tokens`` asks the room its context leaves) ends at the cap,
    ``finish_reason`` ``length``. ``max_batch`` rows are decoded at once; ``threads`` (default
    ``2 * max_batch + 8``) bounds the requests served at once."""

    def __init__(self, model: Any, tokenizer: Any, name: str = "live-model", host: str = "127.0.0.1",
                 port: int = 0, max_model_len: int | None = None, api_key: str | None = None,
                 window_s: float = 0.05, max_batch: int = 64, threads: int | None = None,
                 max_tokens: int | None = None):
        self.tokenizer, self.name = tokenizer, name
        self.max_model_len = max_model_len or int(getattr(model.config, "max_position_embeddings", 2048))
        self.max_tokens = max_tokens or get_settings().live_max_tokens  # the per-call cap
        self.vocab = _vocab(model)
        self.api_key = api_key if api_key is not None else secrets.token_urlsafe(24)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.engine = LiveEngine(model, pad_id=int(pad or 0), window_s=window_s, max_batch=max_batch)
        self.requests = 0
        self.pauses: list[dict[str, Any]] = []  # per pause: mode, seconds its call took, seconds frozen
        # a sampling request holds a thread until its row is done: room for a full batch, one
        # waiting behind it, and the pause routes besides
        self._http = ThreadedServer(create_app(self), host, port, threads or 2 * max_batch + 8, MAX_BODY_BYTES)

    @property
    def model(self) -> Any:
        return self.engine.model

    @model.setter
    def model(self, model: Any) -> None:
        self.engine.model = model

    @property
    def lock(self) -> Any:
        return self.engine.lock

    @property
    def url(self) -> str:
        host, port = self._http.address
        return f"http://{host}:{port}"

    def start(self) -> "LiveModelServer":
        self.engine.start()
        self._http.start()
        return self

    def stop(self) -> None:
        self._http.stop()
        self.engine.stop()

    def register(self, client: Any, tokenizer: str, weight_version: str = "step0", dialect: str = "vllm-generate",
                 pause_api: str = "vllm", **fields: Any) -> dict[str, Any]:
        """Register with the service (probed, exact ids checked); ``tokenizer`` is the name or folder
        the service's workers load to render the chat template (the trainer's own). With
        ``pause_api`` vllm the service pauses this server in keep mode around weight updates."""
        fields.setdefault("capacity", self.engine.max_batch)  # what it decodes at once
        reply = client.add_llm_server(self.url, protocol="generate", dialect=dialect, model=self.name,
                                      tokenizer=tokenizer, max_model_len=self.max_model_len, api_key=self.api_key,
                                      weight_version=weight_version, exact_tokens=True, pause_api=pause_api,
                                      **fields)
        return reply.get("backend", reply)

    # -- pause (vLLM's RL routes) -----------------------------------------------------------------
    def pause(self, mode: str) -> None:
        started = time.monotonic()
        self.engine.pause(mode)  # type: ignore[arg-type]
        self.pauses.append({"mode": mode, "t": time.time(), "server_s": time.monotonic() - started})

    def resume(self) -> None:
        self.engine.resume()
        if self.pauses and "frozen_s" not in self.pauses[-1]:
            self.pauses[-1]["frozen_s"] = time.time() - self.pauses[-1]["t"]

    # -- generation -------------------------------------------------------------------------------
    def sample(self, prompt: list[int], p: Sampling, cancelled: Callable[[], bool] | None = None) -> Row:
        """Sample for one request (``p``: its sampling fields, validated); ``max_tokens`` clipped
        to :attr:`max_tokens` and to the room the context leaves. Raises the row's error."""
        if len(prompt) + 1 > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens")
        eos = self.tokenizer.eos_token_id
        stops = set(p.stop_token_ids) | ({eos} if eos is not None and not p.ignore_eos else set())
        params = RowParams(max_tokens=min(p.max_tokens, self.max_tokens, self.max_model_len - len(prompt)),
                           temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                           repetition_penalty=p.repetition_penalty, seed=p.seed, stop_ids=frozenset(stops),
                           min_tokens=p.min_tokens)
        self.requests += 1
        return self.engine.submit(prompt, params, cancelled=cancelled)

    def completion(self, req: CompletionRequest, cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
        got = self.sample(req.prompt, req, cancelled)
        text = self.tokenizer.decode(got.ids, skip_special_tokens=req.skip_special_tokens)
        choice = {"index": 0, "text": text, "token_ids": got.ids if req.return_token_ids else None,
                  "finish_reason": got.finish_reason,
                  "logprobs": None if req.logprobs is None else {
                      "tokens": [f"token_id:{i}" if req.return_tokens_as_token_ids else self.tokenizer.decode([i])
                                 for i in got.ids],
                      "token_logprobs": got.logprobs}}
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": self.name,
                "choices": [choice], "usage": _usage(req.prompt, got.ids)}

    def generate(self, req: GenerateRequest, cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
        p = req.sampling_params
        got = self.sample(req.token_ids, p, cancelled)
        logprobs = None if p.logprobs is None else {"content": [
            {"token_id": t, "logprob": lp, "top_logprobs": [{"token_id": t, "logprob": lp}]}
            for t, lp in zip(got.ids, got.logprobs)]}
        choice = {"index": 0, "finish_reason": got.finish_reason, "stop_reason": None, "token_ids": got.ids,
                  "weight_versions": got.spans(), "logprobs": logprobs}
        return {"request_id": req.request_id or f"generate-tokens-{uuid.uuid4().hex[:16]}", "model": self.name,
                "created": int(time.time()), "usage": _usage(req.token_ids, got.ids), "output_mode": "tokens",
                "choices": [choice]}


def _usage(prompt: list[int], ids: list[int]) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}


def _vocab(model: Any) -> int | None:
    """The number of ids the model embeds (a prompt or stop id beyond it is refused)."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError):
        size = getattr(getattr(model, "config", None), "vocab_size", None)
        return int(size) if size else None
