"""The fake server itself: its latency model behaves like a batching GPU server, it says so, and it
keeps the real servers' quirks that the recordings cannot show as shapes (tests/llm/test_recorded_contract.py
checks the shapes)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from prorl_celery.fakes.llm.engine import LatencyModel


def _generate(url: str, tokens: int) -> float:
    started = time.monotonic()
    resp = requests.post(f"{url}/generate", json={"prompt_ids": [1, 2, 3], "max_tokens": tokens,
                                                  "ignore_eos": True}, timeout=30)
    assert resp.status_code == 200 and len(resp.json()["response_ids"]) == tokens
    return time.monotonic() - started


def test_time_per_token_grows_with_concurrency_up_to_capacity(fake_llms):
    (proc,) = fake_llms(1, latency="step_s=0.01,capacity=4,slowdown=1")
    alone = _generate(proc.url, 20)  # 20 steps of 10 ms
    started = time.monotonic()
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda _: _generate(proc.url, 20), range(4)))  # 20 steps of 17.5 ms
    four = time.monotonic() - started
    started = time.monotonic()
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda _: _generate(proc.url, 20), range(8)))  # two batches of four
    eight = time.monotonic() - started
    # lower bounds only: a busy machine can make a request slower than the model, never faster,
    # and these are what the latency model promises (the batch cap shows in peak_running below).
    # The batches' walls, not each request's: a loaded node staggers the starts, and a request
    # that runs some steps alone is faster; a batch's steps cost at least 17.5 / 4 ms a request.
    assert alone > 0.18
    assert four > 0.33  # four at once: each step 17.5 ms instead of 10
    assert eight > 0.68  # eight through a capacity of four: two batches one after the other
    stats = proc.stats()
    assert stats["peak_running"] == 4 and stats["completed"] == 13 and stats["aborted"] == 0
    assert 0 < stats["occupancy"] <= stats["busy_fraction"] <= 1


@pytest.mark.unit
def test_speed_factor_and_model_parsing():
    model = LatencyModel.parse("batch:step_s=0.02,capacity=8", speed=0.25)
    assert model.capacity == 8 and model.step_time(1) == 0.08
    assert model.step_time(8) > model.step_time(1)
    assert LatencyModel.parse("none").step_s == 0


def test_health_models_faults_and_banner(fake_llms):
    (proc,) = fake_llms(1)
    assert "test and demo tool" in requests.get(f"{proc.url}/health", timeout=5).json()["note"]
    assert requests.get(f"{proc.url}/v1/models", timeout=5).json()["data"][0]["id"] == "prorl-fake-byte"
    proc.faults(fail_next=1, healthy=False)
    assert requests.get(f"{proc.url}/health", timeout=5).status_code == 503
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert requests.post(f"{proc.url}/v1/chat/completions", json=body, timeout=5).status_code == 500
    assert requests.post(f"{proc.url}/v1/chat/completions", json=body, timeout=5).status_code == 200
    bad = requests.post(f"{proc.url}/generate", json={"prompt_ids": "nope"}, timeout=5)
    assert bad.status_code == 400 and "prompt_ids" in bad.json()["error"]["message"]


def _sglang(url: str, prompt: list[int], **sampling) -> requests.Response:
    return requests.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": sampling,
                                                  "return_logprob": True}, timeout=10)


def test_sglang_quirks_context_check_prefix_and_abort(fake_llms):
    """SGLang's own rules, as its tokenizer_manager applies them: max_new_tokens + prompt must stay
    below the window (``>=`` is refused, so the room minus one is the most); some versions prefix
    output_ids with the prompt; a weight update aborts with finish_reason.type abort. The
    project's SGLang wire reads the prefixed ids back to the generated ones and the abort as a
    retryable BackendAborted."""
    from prorl_celery.errors import BackendAborted
    from prorl_celery.llm.dialects.sglang import SGLangWire

    (plain,) = fake_llms(1, extra=["--max-model-len", "64"])
    (prefixed,) = fake_llms(1, extra=["--max-model-len", "64", "--sglang-prompt-in-output"])
    prompt = list(range(1, 11))
    refused = _sglang(plain.url, prompt, max_new_tokens=54)
    assert refused.status_code == 400 and "maximum context length of 64" in refused.json()["error"]["message"]
    ok = _sglang(plain.url, prompt, max_new_tokens=53, ignore_eos=True)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 53
    assert ok.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 53}
    answer = _sglang(prefixed.url, prompt, max_new_tokens=5, ignore_eos=True).json()
    assert answer["output_ids"][:10] == prompt and len(answer["output_ids"]) == 15
    read = SGLangWire().answer(answer)
    assert read.response_ids == answer["output_ids"][10:] and len(read.logprobs) == 5
    plain.faults(abort_next=1)
    aborted = _sglang(plain.url, prompt, max_new_tokens=5).json()
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and aborted["output_ids"] == []
    with pytest.raises(BackendAborted):
        SGLangWire().answer(aborted)
    assert _sglang(plain.url, prompt, max_new_tokens=5).json()["meta_info"]["finish_reason"]["type"] == "length"


def test_vllm_defaults_and_tool_parser_flag(fake_llms):
    """vLLM's /v1/completions generates 16 tokens when max_tokens is omitted; started without a
    tool parser, tools under tool_choice auto get its 400 naming the flags, and the client reads it
    as a rejected request (not a backend failure)."""
    from prorl_celery.errors import LLMRequestRejected
    from prorl_celery.llm import LLMRequest
    from prorl_celery.llm.clients.chat import ChatClient
    from prorl_celery.llm.models import Protocol
    from prorl_celery.llm.routing import Slot
    from prorl_celery.llm.transport import Call
    from tests.llm.conftest import TOOLS

    (proc,) = fake_llms(1, extra=["--no-tool-parser"])
    body = {"model": "m", "prompt": [1, 2, 3], "ignore_eos": True, "return_token_ids": True}
    choice = requests.post(f"{proc.url}/v1/completions", json=body, timeout=10).json()["choices"][0]
    assert len(choice["token_ids"]) == 16 and choice["finish_reason"] == "length"
    chat = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    refused = requests.post(f"{proc.url}/v1/chat/completions", json=chat, timeout=10)
    assert refused.status_code == 400
    assert "--enable-auto-tool-choice and --tool-call-parser" in refused.json()["error"]["message"]
    forced = requests.post(f"{proc.url}/v1/chat/completions", json={**chat, "tool_choice": "none"}, timeout=10)
    assert forced.status_code == 200
    slot = Slot.direct(backend_id="b", address=proc.url, protocol=Protocol.CHAT, model="m")
    with pytest.raises(LLMRequestRejected, match="--tool-call-parser"), Call(10) as call:
        ChatClient().generate(slot, LLMRequest(messages=chat["messages"], tools=TOOLS), call)


def test_sglang_without_seeded_sampling_is_retried_unseeded(fake_llms):
    """An SGLang that predates ``sampling_seed`` refuses it with a 400; the generate client sends
    the same request again without the seed and gets its turn (the fake saw both)."""
    from prorl_celery.llm import LLMRequest, SamplingParams
    from prorl_celery.llm.clients.generate import GenerateClient
    from prorl_celery.llm.models import Protocol
    from prorl_celery.llm.routing import Slot
    from prorl_celery.llm.transport import Call

    (proc,) = fake_llms(1, extra=["--sglang-no-seed"])
    slot = Slot.direct("old-sglang", proc.url, Protocol.GENERATE, dialect="sglang", model="m",
                       tokenizer="byte", max_model_len=4096)
    request = LLMRequest(messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(seed=3, max_tokens=8))
    with Call(10) as call:
        turn = GenerateClient().generate(slot, request, call)
    assert turn.response_ids and len(turn.logprobs) == len(turn.response_ids)
    sent = [r.get("sampling_params", {}) for r in proc.received()]
    assert len(sent) == 1 and "sampling_seed" not in sent[0]  # only the unseeded one reached generation
    from prorl_celery.llm.dialects.sglang import _no_seed

    assert proc.url in _no_seed  # the seeded one was sent first and refused
    refused = _sglang(proc.url, [1, 2, 3], max_new_tokens=2, sampling_seed=1)
    assert refused.status_code == 400 and "sampling_seed" in refused.json()["error"]["message"]


@pytest.mark.unit
def test_the_fake_is_a_flask_app_its_routes_answer_in_process():
    """The routes are a Flask app over the fake's state: Flask's test client gets the dialects'
    answers and errors without a server (no socket: nothing to watch for a disconnect)."""
    from prorl_celery.fakes.llm.app import create_app
    from prorl_celery.fakes.llm.engine import BatchEngine
    from prorl_celery.fakes.llm.policies import load_policy
    from prorl_celery.fakes.llm.state import FakeLLM

    client = create_app(FakeLLM(load_policy("echo"), BatchEngine(LatencyModel()), "m", 4096)).test_client()
    answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 4, "return_token_ids": True})
    assert answer.status_code == 200 and len(answer.json["choices"][0]["token_ids"]) == 4
    assert client.post("/generate", json={"prompt_ids": [1, 2], "max_tokens": 3}).json["finish_reason"] == "length"
    assert client.post("/v1/chat/completions", data=b"{bad").json["error"]["message"].startswith("invalid JSON body")
    for method, path in (("get", "/nowhere"), ("post", "/health"), ("get", "/v1/chat/completions")):
        missing = getattr(client, method)(path)
        assert (missing.status_code, missing.status) == (404, "404 Not Found")  # the real servers' status line
        assert missing.json["error"] == {"message": f"no route {path}", "type": "NotFoundError", "param": None,
                                         "code": 404}
    assert client.post("/pause?mode=sideways").status_code == 422


def test_every_request_in_flight_reaches_the_engine(fake_llms):
    """The server's thread pool grows with the requests in flight (each holds a thread while the
    engine generates): 40 at once, past the pool it starts with, all run in one batch, as a real
    server admits them, rather than waiting for a thread in front of the engine."""
    from prorl_celery.fakes.llm.server import FIRST_THREADS

    (proc,) = fake_llms(1, latency="step_s=0.02,capacity=64,slowdown=0")
    n = 5 * FIRST_THREADS
    with ThreadPoolExecutor(n) as ex:
        list(ex.map(lambda _: _generate(proc.url, 50), range(n)))  # 50 steps of 20 ms: a second
    stats = proc.stats()
    assert stats["completed"] == n and stats["peak_running"] > 2 * FIRST_THREADS
