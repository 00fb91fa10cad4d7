"""A fake LLM server speaking the real servers' APIs. TEST AND DEMO TOOL: it runs no model.

    prorl-celery fake-llm --port 8100 [--latency-model step_s=0.02,capacity=32] [--speed 0.5]
                          [--policy echo|scripted:FILE|oracle[:NAME]] [--tokenizer byte|NAME_OR_DIR]
                          [--flavor vllm|llama.cpp|sglang] [--no-tool-parser] [--sglang-prompt-in-output]
                          [--sglang-no-seed] [--seeded-prefill-death TOKENS]

Serves ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` (tool calls, logprobs,
``return_token_ids``, ``tool_choice`` required/named forces a call; in vLLM's, llama.cpp's or
SGLang's shape) and the token endpoints of :mod:`prorl_celery.fakes.llm.token_api` (vLLM's
``/v1/completions`` and ``/inference/v1/generate``, llama.cpp's ``/completion``, SGLang's
``/generate``, and the test-only ``fake`` dialect ``/generate`` with ``prompt_ids``), each with its
server's defaults, context rule and error body, as recorded from the real servers
(``tests/fixtures/recorded``, checked by ``tests/llm/test_recorded_contract.py``). A tokenizer (the
built-in byte-level one unless ``--tokenizer`` names a Hugging Face one) and a latency model of a
batching GPU server. Debug endpoints for tests: ``GET /debug/requests?since=N`` (what it received:
endpoint, prompt ids, response ids, sampling_params, status ok|aborted|error), ``GET /debug/stats``
(busy fraction, occupancy, completed, aborted = client disconnects), ``POST /debug/reset``,
``POST /debug/faults`` (``{"fail_next": n, "fail_all": bool, "error_status": 500 (0: drop the
connection), "healthy": bool, "abort_next": n}``; ``abort_next``: SGLang answers the next n with
``finish_reason.type == "abort"``, as during a weight update). Pause and resume around a weight
update as vLLM (``/pause?mode=keep|wait|abort``, ``/resume``, ``/update_weight_version``) and
SGLang (``/pause_generation``, ``/continue_generation``) serve them: :mod:`prorl_celery.fakes.llm.pause_api`;
``/debug/stats`` lists each pause with the seconds it took at the server.
"""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prorl_celery import jsonfast
from prorl_celery.fakes.llm.endpoints import chat_completion, detokenize, models, tokenize
from prorl_celery.fakes.llm import pause_api
from prorl_celery.fakes.llm.token_api import ROUTES, EventStream
from prorl_celery.fakes.llm.engine import BatchEngine, LatencyModel
from prorl_celery.fakes.llm.options import FakeOptions, add_arguments  # noqa: F401  (add_arguments: the CLI's)
from prorl_celery.fakes.llm.policies import load_policy
from prorl_celery.fakes.llm.state import BANNER, FakeLLM
from prorl_celery.fakes.llm.wire import HTTPError
from prorl_celery.llm.tokenizer import get_tokenizer

log = logging.getLogger(__name__)

class Handler(BaseHTTPRequestHandler):
    server_version = "prorl-fake-llm"
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM, SGLang and llama.cpp serve
    disable_nagle_algorithm = True  # as uvicorn: the body is not held back until the headers' ACK
    fake: FakeLLM  # set on the subclass made by make_server

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, body: Any) -> None:
        data = jsonfast.dumps(body)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.fake.dead:  # the dying API server's open connections go with it
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client is gone

    def _error(self, status: int, message: str, type_: str = "BadRequestError",
               body: dict[str, Any] | None = None) -> None:
        self._send(status, body or {"error": {"message": message, "type": type_, "param": None, "code": status}})

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        fake = self.fake
        if url.path in ("/health", "/v1/models", "/models") and not fake.faults["healthy"]:
            return self._error(503, "unhealthy (injected fault)", "ServiceUnavailable")
        if url.path == "/health" and fake.dead:
            return self._send(503, {})
        if url.path == "/health":
            return self._send(200, {"status": "ok", "note": BANNER})
        if url.path in ("/v1/models", "/models"):
            return self._send(200, models(fake))
        if url.path in ("/get_load", "/v1/loads"):  # SGLang's load report, which sglang-router polls
            return self._send(200, [fake.engine.load()])
        if url.path == "/debug/requests":
            query = parse_qs(url.query)
            since = int(query.get("since", ["0"])[0])
            with fake.lock:
                rows = [dict(r) for r in fake.records if r["id"] > since]
            return self._send(200, {"requests": rows})
        if url.path == "/debug/stats":
            with fake.lock:
                extra = {"requests": len(fake.records), "errors": fake.errors, "faults": dict(fake.faults),
                         "pauses": list(fake.pauses)}
            return self._send(200, {**fake.engine.stats(), **extra})
        if url.path in pause_api.GET_ROUTES:
            try:
                return self._send(200, pause_api.handle_get(fake, url.path))
            except HTTPError as exc:
                return self._error(exc.status, str(exc), exc.type, exc.body)
        self._error(404, f"no route {url.path}", "NotFoundError")

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        path = url.path
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = jsonfast.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            return self._error(400, f"invalid JSON body: {exc}")
        try:
            if path in pause_api.POST_ROUTES:
                return self._send(200, pause_api.handle_post(self.fake, path, parse_qs(url.query), body))
            self._route(path, body)
        except HTTPError as exc:
            self._error(exc.status, str(exc), exc.type, exc.body)

    def _route(self, path: str, body: dict[str, Any]) -> None:
        fake = self.fake
        if path == "/debug/reset":
            fake.reset()
            return self._send(200, {"reset": True})
        if path == "/debug/faults":
            with fake.lock:
                fake.faults.update({k: v for k, v in body.items() if k in fake.faults})
                faults = dict(fake.faults)
            return self._send(200, faults)
        handlers = {"/v1/chat/completions": chat_completion, "/chat/completions": chat_completion,
                    "/tokenize": tokenize, "/detokenize": detokenize, **ROUTES}
        if path not in handlers:
            raise HTTPError(404, f"no route {path}", "NotFoundError")
        status = fake.injected_failure() if path not in ("/tokenize", "/detokenize") else None
        if status == 0:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if status is not None:
            raise HTTPError(status, "injected failure", "InternalServerError")
        answer = handlers[path](fake, body, self.connection)
        if isinstance(answer, EventStream):
            self._send_events(answer)
        elif answer is not None:
            self._send(200, answer)

    def _send_events(self, events: EventStream) -> None:
        data = b"".join(b"data: " + jsonfast.dumps(event) + b"\n\n" for event in events)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client is gone


class FakeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024


def make_server(host: str = "127.0.0.1", port: int = 0, policy: str = "echo",
                latency: LatencyModel | None = None, model: str = "prorl-fake-byte",
                max_model_len: int = 32768, tokenizer: str = "byte",
                options: FakeOptions | None = None) -> tuple[FakeHTTPServer, FakeLLM]:
    fake = FakeLLM(load_policy(policy), BatchEngine(latency or LatencyModel()), model, max_model_len,
                   get_tokenizer(tokenizer), options)
    handler = type("BoundHandler", (Handler,), {"fake": fake})
    server = FakeHTTPServer((host, port), handler)
    def die() -> None:
        server.shutdown()
        server.server_close()  # refused from now on, as the dead API server's port

    fake.on_death = lambda: threading.Thread(target=die, daemon=True).start()  # type: ignore[method-assign]
    return server, fake


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    latency = LatencyModel.parse(args.latency_model, speed=args.speed, capacity=args.capacity)
    options = FakeOptions.from_args(args)
    server, _ = make_server(args.host, args.port, args.policy, latency, args.model, args.max_model_len,
                            args.tokenizer, options)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    host, port = server.server_address[:2]
    print(BANNER, flush=True)
    print(f"fake-llm ready http://{host}:{port} policy={args.policy} {latency.model_dump()}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m prorl_celery.fakes.llm.server", description=BANNER)
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
