"""SGLang's native ``/generate`` as a dialect of the generate protocol, against the fake server
speaking it: the same exact-id trajectory and logprobs as the plain dialect, SGLang's field names
on the wire, its finish reasons, and registration over HTTP."""
from __future__ import annotations


import pytest
import requests

from prorl_celery.errors import ContextWindowExceeded
from prorl_celery.llm import LLMRequest, SamplingParams
from prorl_celery.llm.dialects.base import Generated
from prorl_celery.llm.dialects.sglang import SGLangWire
from prorl_celery.errors import BackendAborted
from prorl_celery.llm.tokenizer import ByteTokenizer
from tests.llm.conftest import add, tool_rollout

WINDOW = 4096


def rollout(pool, rollout_id: str) -> list:
    return tool_rollout(pool, rollout_id, sampling=SamplingParams(temperature=0.7, seed=7, top_k=20))[0]


def test_sglang_dialect_gives_the_plain_dialects_trajectory(pool, fake_llms, script):
    plain, sglang = fake_llms(2, policy=f"scripted:{script}")
    plain_id = add(pool, plain, protocol="generate", max_model_len=WINDOW)
    expected = rollout(pool, "plain")
    pool.registry.remove(plain_id)
    add(pool, sglang, protocol="generate", dialect="sglang", max_model_len=WINDOW)
    turns = rollout(pool, "sglang")

    def fields(turn) -> tuple:
        return (turn.prompt_ids, turn.response_ids, turn.logprobs, turn.content, turn.finish_reason,
                [(c.name, c.arguments) for c in turn.tool_calls])

    assert [fields(t) for t in turns] == [fields(t) for t in expected]
    assert turns[1].prompt_ids[:len(turns[0].prompt_ids)] == turns[0].prompt_ids  # appended, not re-tokenised
    received = sglang.received()
    assert [r["endpoint"] for r in received] == ["sglang"] * 3
    assert [r["prompt_ids"] for r in received] == [t.prompt_ids for t in turns]
    assert [r["response_ids"] for r in received] == [t.response_ids for t in turns]
    stop_ids = sorted(ByteTokenizer().stop_ids)
    for r in received:
        # the full sampling set, in SGLang's names; the clip leaves one token (SGLang refuses >=)
        assert r["sampling_params"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 20, "sampling_seed": 7,
                                        "min_p": 0.0, "repetition_penalty": 1.0,
                                        "max_new_tokens": WINDOW - len(r["prompt_ids"]) - 1,
                                        "stop_token_ids": stop_ids, "skip_special_tokens": False}
    assert [r["endpoint"] for r in plain.received()] == ["generate"] * 3


def test_sglang_finish_reasons_and_context_window(pool, fake_llms):
    (proc,) = fake_llms(1, extra=["--max-model-len", "96"])
    add(pool, proc, protocol="generate", dialect="sglang")
    messages = [{"role": "user", "content": "a long question"}]
    cut = pool.generate("cut", LLMRequest(messages=messages, sampling=SamplingParams(max_tokens=5)))
    assert cut.finish_reason == "length" and cut.format_error == "length" and len(cut.response_ids) == 5
    nxt = pool.generate("cut", LLMRequest(messages=messages + [cut.message, {"role": "user", "content": "go"}],
                                          previous=cut, sampling=SamplingParams(max_tokens=20)))
    im_end = ByteTokenizer.SPECIAL["<|im_end|>"]
    glue = len(cut.prompt_ids) + 5
    assert nxt.prompt_ids[glue:glue + 2] == [im_end, ord("\n")]
    assert nxt.finish_reason == "stop" and nxt.response_ids[-1] == im_end
    assert len(nxt.logprobs) == len(nxt.response_ids)
    assert proc.received()[0]["sampling_params"]["max_new_tokens"] == 5
    assert proc.received()[-1]["sampling_params"]["max_new_tokens"] == 20  # always stated, never SGLang's 128
    with pytest.raises(ContextWindowExceeded):  # the server's 400, read as the typed error
        pool.generate("ctx", LLMRequest(messages=[{"role": "user", "content": "x" * 100}]))


def test_register_the_sglang_dialect_over_http(api, pool):
    body = {"address": "http://10.1.0.9:30000", "protocol": "generate", "dialect": "sglang", "probe": False}
    resp = requests.post(f"{api}/llm_servers", json=body, timeout=10)
    assert resp.status_code == 201 and resp.json()["backend"]["dialect"] == "sglang"
    bid = resp.json()["id"]
    assert requests.get(f"{api}/llm_servers/{bid}", timeout=10).json()["dialect"] == "sglang"
    assert pool.registry.get(bid).dialect == "sglang"
    bad = requests.post(f"{api}/llm_servers", json={"address": "http://10.1.0.10:30000", "dialect": "vllm-generate",
                                                    "probe": False}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "dialect"
    assert "generate" in bad.json()["error"]["message"]
    no_dialect = requests.post(f"{api}/llm_servers", json={"address": "http://10.1.0.12:8000", "protocol": "generate",
                                                           "probe": False}, timeout=10)
    assert no_dialect.status_code == 400 and no_dialect.json()["error"]["field"] == "dialect"
    plain = requests.post(f"{api}/llm_servers", json={"address": "http://10.1.0.11:8000", "probe": False}, timeout=10)
    assert plain.json()["backend"]["dialect"] is None


@pytest.mark.unit
def test_sglang_answer_of_older_versions_and_aborts():
    wire = SGLangWire()
    # before output_ids, the ids came only with the logprobs
    older = {"text": "hi", "meta_info": {"output_token_logprobs": [[-0.5, 104, None], [-0.25, 105, "i"]],
                                         "finish_reason": {"type": "length", "length": 2}}}
    assert wire.answer(older) == Generated([104, 105], [-0.5, -0.25], "length")
    with pytest.raises(BackendAborted, match="aborted the request: weights updating"):
        wire.answer({"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "weights updating"}}})
