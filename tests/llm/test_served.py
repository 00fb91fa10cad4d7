"""How a call was served, beyond its ids: the MoE routing trace (router replay) and the prefix-cache
hit, read from the real servers' fields and passed on unchanged, absent where a server did not
report them. Against the fake server playing vLLM (chat, completions, its generate API) and
SGLang, each trace compared with the one the fake's debug record says it sent."""
from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import pytest

from prorl_celery.llm import LLMRequest
from prorl_celery.llm.dialects import served
from prorl_celery.llm.dialects.sglang import SGLangWire
from prorl_celery.llm.dialects.vllm import VllmChat
from prorl_celery.rollout.segments import harness_fields
from prorl_celery.rollout.trajectory import assistant_messages
from prorl_celery.rollout.transcript import call_of
from tests.llm.conftest import add, tool_rollout

RECORDED = Path(__file__).parents[1] / "fixtures" / "recorded"
SHAPE = ["--routed-experts", "3x2"]


def _recorded(name: str) -> dict:
    data = json.loads((RECORDED / name).read_text())
    return data.get("response", data)


@pytest.mark.unit
def test_a_real_answer_without_the_server_flags_reports_nothing():
    """vLLM 0.32's recorded answers: ``routed_experts`` and ``prompt_tokens_details`` null -> absent;
    llama.cpp's recorded chat reports its cache hit (19 of 33 prompt tokens)."""
    for name in ("vllm/chat_return_token_ids.json", "vllm/completions_ids.json", "vllm/generate.json"):
        data = _recorded(name)
        assert served.openai(data, data["choices"][0]) == served.NOTHING, name
    data = _recorded("llamacpp/chat_logprobs.json")
    assert served.openai(data, data["choices"][0]) == served.Served(19, None)
    answer = VllmChat().answer(_recorded("vllm/chat_return_token_ids.json"), LLMRequest(messages=[{"role": "user", "content": "x"}]), None)
    assert answer.served == served.NOTHING
    meta = {"cached_tokens": 32, "routed_experts": "AAAAAA=="}
    assert served.sglang(meta) == served.Served(32, "AAAAAA==")
    assert served.sglang({"cached_tokens": -1, "routed_experts": ""}) == served.NOTHING


def _trace_of(record: dict) -> list:
    return record["routed_experts"]


def test_vllm_chat_and_token_apis_pass_the_trace_and_the_hit_on(pool, fake_llms, script):
    chat, completions, generate = fake_llms(3, policy=f"scripted:{script}",
                                            extra=[*SHAPE, "--prompt-tokens-details"])
    for proc, spec in ((chat, {}), (completions, {"protocol": "generate", "dialect": "vllm-completions"}),
                       (generate, {"protocol": "generate", "dialect": "vllm-generate"})):
        bid = add(pool, proc, max_model_len=4096, **spec)
        turns = tool_rollout(pool, f"served-{bid}")[0]
        pool.registry.remove(bid)
        received = [r for r in proc.received() if r.get("status") == "ok"]
        assert len(turns) == len(received) == 3
        for turn, record in zip(turns, received):
            assert turn.routed_experts == _trace_of(record) and len(turn.routed_experts) == len(record["response_ids"])
            assert all(len(layers) == 3 and all(len(set(k)) == 2 for k in layers) for layers in turn.routed_experts)
            assert turn.cached_tokens == record["cached_tokens"]
        # each turn's prompt extends the last: the later ones hit the cache, in whole blocks
        assert turns[0].cached_tokens == 0 and all(t.cached_tokens >= 16 and t.cached_tokens % 16 == 0
                                                   for t in turns[1:]), [t.cached_tokens for t in turns]


def test_sglang_asks_for_the_trace_only_where_registered_and_it_arrives_as_sglang_sent_it(pool, fake_llms, script):
    (proc,) = fake_llms(1, policy=f"scripted:{script}", extra=SHAPE)
    bid = add(pool, proc, protocol="generate", dialect="sglang", max_model_len=4096)
    plain = tool_rollout(pool, "sglang-plain")[0]
    # the fake traced them (its record) but, not asked, sent none: the turns have none
    assert all(r["routed_experts"] for r in proc.received()) and all(t.routed_experts is None for t in plain)
    pool.registry.remove(bid)
    add(pool, proc, protocol="generate", dialect="sglang", max_model_len=4096, routed_experts=True)
    since = len(proc.received())
    turns = tool_rollout(pool, "sglang-traced")[0]
    received = proc.received(since)
    for turn, record in zip(turns, received):
        flat = struct.unpack(f"<{len(base64.b64decode(turn.routed_experts)) // 4}i", base64.b64decode(turn.routed_experts))
        assert list(flat) == [e for token in record["routed_experts"] for layer in token for e in layer]
        assert turn.cached_tokens == record["cached_tokens"]
    assert SGLangWire.routed_experts_request == {"return_routed_experts": True}


@pytest.mark.unit
def test_the_trace_is_stored_only_where_reported_and_reaches_both_views():
    from prorl_celery.llm.models import Protocol, Turn
    from prorl_celery.rollout.transcript import MODEL

    def turn(prompt, response, **kw):
        return Turn(backend_id="b1", address="http://replica-1:8000", weight_version="v", protocol=Protocol.GENERATE,
                    model="m", content="x", prompt_ids=prompt, response_ids=response, logprobs=[-0.1] * len(response),
                    message_count=1, **kw)

    plain, traced = turn([1, 2], [3]), turn([1, 2, 3, 4], [5, 6], cached_tokens=16, routed_experts=[[[1, 2]], [[3, 4]]])
    first, second = call_of(plain, None), call_of(traced, plain)
    assert "routed_experts" not in first.meta and "cached_tokens" not in first.meta
    assert second.meta["routed_experts"] == [[[1, 2]], [[3, 4]]] and second.meta["cached_tokens"] == 16
    fields = harness_fields([first, second])
    assert [seg["served"] for seg in fields["segments"]] == [[
        {"call": 0, "backend_id": "b1", "address": "http://replica-1:8000"},
        {"call": 1, "backend_id": "b1", "address": "http://replica-1:8000", "cached_tokens": 16,
         "routed_experts": [[[1, 2]], [[3, 4]]]}]]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x", "source": MODEL, "call": 0},
                {"role": "assistant", "content": "x", "source": MODEL, "call": 1}]
    out = assistant_messages(messages, [plain, traced])
    assert "routed_experts" not in out[1] and out[1]["address"] == "http://replica-1:8000"
    assert out[2]["routed_experts"] == [[[1, 2]], [[3, 4]]] and out[2]["cached_tokens"] == 16
