"""Serve a trainer's live model as a ``generate`` backend, for CPU and small runs (a real GPU run
registers its vLLM instead): a small HTTP server in the trainer's process, speaking vLLM's
``/v1/completions`` with a token-id prompt — the ``vllm-completions`` dialect of
:mod:`prorl_celery.llm.clients.vllm` — and sampling with Hugging Face ``generate`` from the very weights
the trainer is updating.

Why this dialect: its answer is exactly what ``generate`` gives honestly — the sampled ids and,
for each, the logprob of the model's raw distribution (``raw_logprobs``, vLLM's default mode),
read from the unprocessed logits; no text round trip. Sampling fields it cannot honour (stop
strings, ``n > 1``, streaming) are refused with a 400 naming the field, never ignored.

    server = LiveModelServer(model, tokenizer).start()
    server.register(client, tokenizer=model_dir)     # POST /llm_servers, probed
"""
from __future__ import annotations

import json
import secrets
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from prorl_celery.errors import error_body


class CompletionRequest(BaseModel):
    """The ``/v1/completions`` fields the ``vllm-completions`` wire sends; anything else is refused."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: list[int] = Field(min_length=1, description="Token ids (a text prompt is not served).")
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
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    echo: bool = Field(False)
    n: int = Field(1, ge=1, le=1)
    stream: bool = Field(False)

    @field_validator("stop")
    @classmethod
    def _no_stop_strings(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError("stop strings are not served here; use stop_token_ids")
        return value

    @field_validator("echo", "stream")
    @classmethod
    def _off(cls, value: bool) -> bool:
        if value:
            raise ValueError("not served here")
        return value


class Sampled(BaseModel):
    ids: list[int]
    logprobs: list[float]
    finish_reason: str


class LiveModelServer:
    """The model behind one lock (``generate`` calls run one at a time, and never while the caller
    holds :attr:`lock` — hold it to change weights outside a trainer's step). The model is the
    trainer's own object: an optimizer step changes what the next request samples from."""

    def __init__(self, model: Any, tokenizer: Any, name: str = "live-model", host: str = "127.0.0.1",
                 port: int = 0, max_model_len: int | None = None, api_key: str | None = None):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.max_model_len = max_model_len or int(getattr(model.config, "max_position_embeddings", 2048))
        self.api_key = api_key if api_key is not None else secrets.token_urlsafe(24)
        self.lock = threading.Lock()
        self.requests = 0
        self._rng: Any = None  # torch's CPU generator state between unseeded requests
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "LiveModelServer":
        self._thread = threading.Thread(target=self._http.serve_forever, name="live-model-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def register(self, client: Any, tokenizer: str, weight_version: str = "step0", **fields: Any) -> dict[str, Any]:
        """Register with the service (probed, exact ids checked); ``tokenizer`` is the name or folder
        the service's workers load to render the chat template (the trainer's own)."""
        reply = client.add_llm_server(self.url, protocol="generate", dialect="vllm-completions", model=self.name,
                                      tokenizer=tokenizer, max_model_len=self.max_model_len, api_key=self.api_key,
                                      weight_version=weight_version, exact_tokens=True, **fields)
        return reply.get("backend", reply)

    # -- generation -----------------------------------------------------------------------
    def sample(self, req: CompletionRequest) -> Sampled:
        import torch

        if len(req.prompt) + 1 > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens")
        max_new = min(req.max_tokens, self.max_model_len - len(req.prompt))
        stops = set(req.stop_token_ids) | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None
                                           else set())
        with self.lock, torch.random.fork_rng(devices=[]), torch.no_grad():
            # the server's own random stream (or the request's seed): the trainer's stays untouched,
            # and unseeded requests do not all replay the same draws
            if req.seed is not None:
                torch.manual_seed(req.seed)
            elif self._rng is not None:
                torch.set_rng_state(self._rng)
            was_training = self.model.training
            self.model.eval()
            try:
                out = self.model.generate(**self._generate_kwargs(req, max_new, stops))
            finally:
                self.model.train(was_training)
            if req.seed is None:
                self._rng = torch.get_rng_state()
            self.requests += 1
        ids = out.sequences[0, len(req.prompt):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), dim=-1)[token].item() for step, token in zip(out.logits, ids)]
        finish = "stop" if ids and ids[-1] in stops and not req.ignore_eos else "length"
        return Sampled(ids=ids, logprobs=logprobs, finish_reason=finish)

    def _generate_kwargs(self, req: CompletionRequest, max_new: int, stops: set[int]) -> dict[str, Any]:
        """Every field stated, so nothing comes from the model's generation config."""
        import torch
        from transformers import GenerationConfig

        sample = req.temperature > 0
        config = GenerationConfig(
            max_new_tokens=max_new, min_new_tokens=req.min_tokens or None, do_sample=sample,
            temperature=req.temperature if sample else 1.0, top_p=req.top_p if sample else 1.0,
            top_k=max(req.top_k, 0) if sample else 0, min_p=req.min_p or None,
            repetition_penalty=req.repetition_penalty, eos_token_id=None if req.ignore_eos else sorted(stops),
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(stops),
            return_dict_in_generate=True, output_logits=True, use_cache=True)
        device = next(self.model.parameters()).device
        ids = torch.tensor([req.prompt], device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "generation_config": config}

    def completion(self, req: CompletionRequest) -> dict[str, Any]:
        got = self.sample(req)
        text = self.tokenizer.decode(got.ids, skip_special_tokens=req.skip_special_tokens)
        choice = {"index": 0, "text": text, "token_ids": got.ids if req.return_token_ids else None,
                  "finish_reason": got.finish_reason,
                  "logprobs": None if req.logprobs is None else {
                      "tokens": [f"token_id:{i}" if req.return_tokens_as_token_ids else self.tokenizer.decode([i])
                                 for i in got.ids],
                      "token_logprobs": got.logprobs}}
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": self.name,
                "choices": [choice], "usage": {"prompt_tokens": len(req.prompt), "completion_tokens": len(got.ids),
                                               "total_tokens": len(req.prompt) + len(got.ids)}}


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
            return self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if not self._authorised():
                return None
            if self.path != "/v1/completions":
                return self._error(404, f"no route {self.path}")
            try:
                req = CompletionRequest.model_validate_json(raw)
            except ValidationError as exc:
                first = exc.errors()[0]
                field = ".".join(str(p) for p in first["loc"]) or None
                return self._error(400, f"{field}: {first['msg']}", field)
            try:
                return self._send(200, server.completion(req))
            except ValueError as exc:
                return self._error(400, str(exc), "prompt")
            except Exception as exc:  # noqa: BLE001 - the service sees a 500 and retries elsewhere
                return self._error(500, f"{type(exc).__name__}: {exc}")

    return Handler
