"""Serve a trainer's live model as a ``generate`` backend, for CPU and small runs (a real GPU run
registers its vLLM instead): a small HTTP server in the trainer's process that speaks two of
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

import json
import secrets
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from prorl_celery.errors import error_body
from prorl_celery.integrations.live_engine import LiveEngine, Row, RowParams


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
                 window_s: float = 0.05, max_batch: int = 64):
        self.tokenizer, self.name = tokenizer, name
        self.max_model_len = max_model_len or int(getattr(model.config, "max_position_embeddings", 2048))
        self.api_key = api_key if api_key is not None else secrets.token_urlsafe(24)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.engine = LiveEngine(model, pad_id=int(pad or 0), window_s=window_s, max_batch=max_batch)
        self.requests = 0
        self.pauses: list[dict[str, Any]] = []  # per pause: mode, seconds its call took, seconds frozen
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        self._thread: threading.Thread | None = None

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
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "LiveModelServer":
        self.engine.start()
        self._thread = threading.Thread(target=self._http.serve_forever, name="live-model-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
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


PAUSE_MODES = ("abort", "wait", "keep")


def _handler(server: LiveModelServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # the trainer's output stays readable
            pass

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, field: str | None = None) -> None:
            self._send(status, error_body("invalid_request" if status < 500 else "server_error", message, field))

        def _authorised(self) -> bool:
            # bytes: compare_digest raises on a str with non-ASCII characters (http.server decodes
            # headers as latin-1, which encoding back recovers)
            given = self.headers.get("Authorization", "").encode("latin-1", "replace")
            if not server.api_key or secrets.compare_digest(given, f"Bearer {server.api_key}".encode()):
                return True
            self._error(401, "missing or wrong bearer token")
            return False

        def do_GET(self) -> None:
            if self.path == "/health":
                return self._send(200, {"status": "ok"})
            if not self._authorised():
                return None
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [
                    {"id": server.name, "object": "model", "max_model_len": server.max_model_len}]})
            if self.path == "/is_paused":
                return self._send(200, {"is_paused": server.engine.paused})
            if self.path == "/weight_info":
                return self._send(200, {"weight_version": server.engine.version})
            return self._error(404, f"no route {self.path}")

        def _parse(self, model: type[BaseModel], raw: bytes) -> Any:
            try:
                return model.model_validate_json(raw or b"{}")
            except ValidationError as exc:
                first = exc.errors()[0]
                field = ".".join(str(p) for p in first["loc"]) or None
                self._error(400, f"{field}: {first['msg']}", field)
                return None

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if not self._authorised():
                return None
            url = urlsplit(self.path)
            if url.path == "/pause":
                mode = (parse_qs(url.query).get("mode") or ["abort"])[0]
                if mode not in PAUSE_MODES:
                    return self._error(422, f"mode: one of {', '.join(PAUSE_MODES)} (got {mode!r})", "mode")
                server.pause(mode)
                return self._send(200, {"status": "paused"})
            if url.path == "/resume":
                server.resume()
                return self._send(200, {"status": "resumed"})
            if url.path == "/update_weight_version":
                try:
                    version = json.loads(raw or b"{}").get("new_version")
                except (ValueError, AttributeError):
                    version = None
                if not isinstance(version, str) or not version:
                    return self._error(422, "new_version: a non-empty string is required", "new_version")
                server.engine.name_version(version)
                return self._send(200, {"success": True, "new_version": version})
            if url.path == "/v1/completions":
                req, answer = self._parse(CompletionRequest, raw), server.completion
            elif url.path == "/inference/v1/generate":
                req, answer = self._parse(GenerateRequest, raw), server.generate
            else:
                return self._error(404, f"no route {url.path}")
            if req is None:
                return None
            try:
                return self._send(200, answer(req))
            except ValueError as exc:
                return self._error(400, str(exc), "prompt")
            except Exception as exc:  # noqa: BLE001 - the service sees a 500 and retries elsewhere
                return self._error(500, f"{type(exc).__name__}: {exc}")

    return Handler
