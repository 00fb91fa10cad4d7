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
together (a group's n rollouts) are decoded as one batch, from the very weights the trainer is
updating, with each sampled id's logprob of the model's raw distribution (vLLM's default
``raw_logprobs``). Sampling fields it cannot honour (stop strings, ``n > 1``, penalties other
than repetition, streaming) are refused with a 400 naming the field, never ignored.

    server = LiveModelServer(model, tokenizer).start()
    server.register(client, tokenizer=model_dir)     # POST /llm_servers, probed; pause_api vllm
    ...
    client.pause("keep"); optimizer.step(); client.resume(weight_version="step1")
"""
from __future__ import annotations

import secrets
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from prorl_celery.integrations.live_app import ThreadedServer, create_app
from prorl_celery.integrations.live_engine import LiveEngine, Row, RowParams

MAX_BODY_BYTES = 16 * 2**20  # a prompt of 1M token ids is ~8 MB of JSON


class _Sampling(BaseModel):
    """The sampling fields both token routes take; a field the server cannot honour is refused."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 or 0: off.")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = Field(None, ge=0, le=0, description="0: the sampled token's logprob only.")
    n: int = Field(1, ge=1, le=1)

    @field_validator("stop")
    @classmethod
    def _no_stop_strings(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError("stop strings are not served here; use stop_token_ids")
        return value


class CompletionRequest(_Sampling):
    """The ``/v1/completions`` fields the ``vllm-completions`` wire sends; anything else is refused."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: list[int] = Field(min_length=1, description="Token ids (a text prompt is not served).")
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    echo: bool = Field(False)
    stream: bool = Field(False)

    @field_validator("echo", "stream")
    @classmethod
    def _off(cls, value: bool) -> bool:
        if value:
            raise ValueError("not served here")
        return value


class GenerateParams(_Sampling):
    """``sampling_params`` of ``/inference/v1/generate``: vLLM's ``SamplingParams`` fields the
    ``vllm-generate`` wire sends; what this server cannot honour is refused, never ignored."""

    model_config = ConfigDict(extra="forbid")

    presence_penalty: float = Field(0.0, ge=0, le=0, description="not served here")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="not served here")
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateParams = Field(default_factory=GenerateParams)
    model: str | None = None
    request_id: str | None = None
    output_mode: str = "tokens"
    stream: bool = Field(False)

    @field_validator("stream")
    @classmethod
    def _off(cls, value: bool) -> bool:
        if value:
            raise ValueError("not served here")
        return value


class LiveModelServer:
    """The trainer's own model object, served: an optimizer step changes what the next decode
    step samples from. Write weights only while paused (``POST /pause``, i.e. the service's
    ``client.pause("keep")``) or while holding :attr:`lock` (held for every forward pass)."""

    def __init__(self, model: Any, tokenizer: Any, name: str = "live-model", host: str = "127.0.0.1",
                 port: int = 0, max_model_len: int | None = None, api_key: str | None = None,
                 window_s: float = 0.05, max_batch: int = 64, threads: int | None = None):
        self.tokenizer, self.name = tokenizer, name
        self.max_model_len = max_model_len or int(getattr(model.config, "max_position_embeddings", 2048))
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
    def sample(self, prompt: list[int], max_tokens: int, temperature: float, top_p: float, top_k: int,
               min_p: float, repetition_penalty: float, seed: int | None, stop_token_ids: list[int],
               min_tokens: int, ignore_eos: bool) -> Row:
        if len(prompt) + 1 > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens")
        eos = self.tokenizer.eos_token_id
        stops = set(stop_token_ids) | ({eos} if eos is not None and not ignore_eos else set())
        params = RowParams(max_tokens=min(max_tokens, self.max_model_len - len(prompt)), temperature=temperature,
                           top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                           stop_ids=frozenset(stops), min_tokens=min_tokens)
        row = self.engine.submit(prompt, params)
        self.requests += 1
        return row

    def completion(self, req: CompletionRequest) -> dict[str, Any]:
        got = self.sample(req.prompt, req.max_tokens, req.temperature, req.top_p, req.top_k, req.min_p,
                          req.repetition_penalty, req.seed, req.stop_token_ids, req.min_tokens, req.ignore_eos)
        text = self.tokenizer.decode(got.ids, skip_special_tokens=req.skip_special_tokens)
        choice = {"index": 0, "text": text, "token_ids": got.ids if req.return_token_ids else None,
                  "finish_reason": got.finish_reason,
                  "logprobs": None if req.logprobs is None else {
                      "tokens": [f"token_id:{i}" if req.return_tokens_as_token_ids else self.tokenizer.decode([i])
                                 for i in got.ids],
                      "token_logprobs": got.logprobs}}
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": self.name,
                "choices": [choice], "usage": _usage(req.prompt, got.ids)}

    def generate(self, req: GenerateRequest) -> dict[str, Any]:
        p = req.sampling_params
        got = self.sample(req.token_ids, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty,
                          p.seed, p.stop_token_ids, p.min_tokens, p.ignore_eos)
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
