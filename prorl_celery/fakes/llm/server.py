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

The routes are a Flask app (:mod:`prorl_celery.fakes.llm.app`) served by waitress, as the API and
the sandbox host are. What the fake needs beyond waitress's defaults is below: the client's socket
in the environ (the engine aborts a sequence whose client hung up, as vLLM does), connections held
as long as a client keeps them (the real servers' keep-alive), and a thread for every request in
flight: a generation waits in the engine for its tokens, so a fixed pool would queue requests in
front of the engine that a real server admits (and reports in its load), so the pool grows with
the requests in flight.
"""
from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ThreadedTaskDispatcher, WSGITask

from prorl_celery.fakes.llm.app import CLOSE, SOCKET, create_app
from prorl_celery.fakes.llm.engine import BatchEngine, LatencyModel
from prorl_celery.fakes.llm.options import (  # noqa: F401  (add_arguments: the CLI's)
    DEFAULT_MAX_MODEL_LEN, FakeOptions, add_arguments)
from prorl_celery.fakes.llm.policies import load_policy
from prorl_celery.fakes.llm.state import BANNER, FakeLLM
from prorl_celery.llm.tokenizer import get_tokenizer

log = logging.getLogger(__name__)
FIRST_THREADS, MOST_THREADS = 8, 4096  # threads to start with, and the most requests served at once
SERVER_OPTIONS: dict[str, Any] = {
    "ident": "prorl-fake-llm", "asyncore_use_poll": True, "backlog": 1024,
    "connection_limit": 8192, "channel_timeout": 3600,  # a pooled client connection is not cut under it
    "log_socket_errors": False,  # a client that hangs up mid-answer is a test's normal case here
    "clear_untrusted_proxy_headers": False,  # no proxy in front: spare every request the header filter
}


class _Task(WSGITask):
    """A request with what the fake's routes need beyond WSGI (:mod:`prorl_celery.fakes.llm.app`):
    its connection's socket, and a way to close the connection after the answer."""

    def get_environment(self) -> dict[str, Any]:
        environ = super().get_environment()
        environ[SOCKET] = self.channel.socket
        environ[CLOSE] = self.set_close_on_finish
        return environ


class _Channel(HTTPChannel):
    task_class = _Task


class _Server(TcpWSGIServer):
    channel_class = _Channel


class GrowingDispatcher(ThreadedTaskDispatcher):
    """Waitress's thread pool, doubled (up to ``most``) whenever a request would otherwise wait for
    a thread: each thread holds one generation until the engine finishes it."""

    def __init__(self, first: int, most: int):
        super().__init__()
        self.most = most
        self.set_thread_count(first)

    def add_task(self, task: Any) -> None:
        with self.lock:
            running = len(self.threads) - self.stop_count
            idle = running - self.active_count - len(self.queue)
            more = min(self.most, 2 * running) if idle < 1 and running < self.most else 0
        if more:
            self.set_thread_count(more)
        super().add_task(task)


class FakeServer:
    """The fake's HTTP server: ``serve_forever()`` in a thread, ``shutdown()`` from another,
    then ``server_close()``; ``server_address`` is (host, port)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        self._map: dict[int, Any] = {}
        self._dispatcher = GrowingDispatcher(FIRST_THREADS, MOST_THREADS)
        self._server = _Server(app, map=self._map, dispatcher=self._dispatcher,
                               adj=Adjustments(host=host, port=port, **SERVER_OPTIONS))
        self.server_address = (self._server.effective_host, self._server.effective_port)
        self._stop, self._stopped = threading.Event(), threading.Event()
        self._stopped.set()

    def serve_forever(self, poll_interval: float = 0.2) -> None:
        """Serve until :meth:`shutdown`; then close every connection."""
        self._stopped.clear()
        try:
            while not self._stop.is_set():
                wasyncore.loop(timeout=poll_interval, map=self._map, use_poll=True, count=1)
        finally:
            wasyncore.close_all(self._map)  # in the loop's own thread: it owns the map
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait until it returned."""
        self._stop.set()
        if not self._map:
            return
        self._server.pull_trigger()
        self._stopped.wait(10)

    def server_close(self) -> None:
        if not self._stopped.is_set():
            self.shutdown()
        wasyncore.close_all(self._map)
        self._dispatcher.shutdown(cancel_pending=True, timeout=1)


def make_server(host: str = "127.0.0.1", port: int = 0, policy: str = "echo",
                latency: LatencyModel | None = None, model: str = "prorl-fake-byte",
                max_model_len: int = DEFAULT_MAX_MODEL_LEN, tokenizer: str = "byte",
                options: FakeOptions | None = None) -> tuple[FakeServer, FakeLLM]:
    fake = FakeLLM(load_policy(policy), BatchEngine(latency or LatencyModel()), model, max_model_len,
                   get_tokenizer(tokenizer), options)
    server = FakeServer(create_app(fake), host, port)

    def die() -> None:
        server.shutdown()
        server.server_close()  # refused from now on, as the dead API server's port

    fake.on_death = lambda: threading.Thread(target=die, daemon=True).start()  # type: ignore[method-assign]
    return server, fake


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)  # a burst waits while the pool grows: expected
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
