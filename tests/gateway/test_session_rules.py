"""The gateway session's rules one at a time, without a server: budgets reserved (not checked),
the trainer's sampling authority, messages reduced to what a template renders, and provenance
tags only the store writes."""
from __future__ import annotations

import json
import threading

import pytest

from prorl_celery.errors import BudgetSpent, QuotaExceeded, RateLimited
from prorl_celery.gateway.apis.base import BadCall
from prorl_celery.gateway.apis.openai_chat import OpenAIChat
from prorl_celery.gateway.budget import Budget, Ledger, Limits
from prorl_celery.gateway.sampling import SamplingAuthority
from prorl_celery.llm.models import SamplingParams
from prorl_celery.rollout.store import RolloutQuota
from prorl_celery.rollout.transcript import generated_by, tagged

pytestmark = pytest.mark.unit


def _ledger(budget: Budget, limits: Limits = Limits(), quota: RolloutQuota = RolloutQuota()) -> Ledger:
    return Ledger(budget, limits, quota)


def test_concurrent_calls_reserve_calls_and_tokens():
    ledger = _ledger(Budget(max_calls=2, max_tokens=64), Limits(max_concurrent=64, burst=64))
    grants, refused = [], []

    def one() -> None:
        ledger.enter()
        try:
            grants.append(ledger.reserve(None, 10))
        except BudgetSpent as exc:
            ledger.leave()
            refused.append(exc.reason)

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(grants) == 1 and grants[0].tokens == 64  # the first takes what is left: no second fits
    assert len(refused) == 11 and set(refused) == {"max_tokens"}
    ledger.settle(grants[0], 40, 100)  # it generated 40: 24 are free again, for one more call
    ledger.enter()
    assert ledger.reserve(500, 10).tokens == 24
    ledger.enter()
    with pytest.raises(BudgetSpent, match="max_calls"):
        ledger.reserve(1, 10)


def test_every_operation_passes_the_rate_and_the_concurrency_cap():
    ledger = _ledger(Budget(), Limits(max_concurrent=2, ops_per_s=0.001, burst=3, max_ops=10))
    ledger.enter()
    ledger.enter()
    with pytest.raises(RateLimited, match="max_concurrent"):
        ledger.enter()
    ledger.leave()
    ledger.enter()  # the third of the burst
    ledger.leave()
    with pytest.raises(RateLimited, match="rate"):
        ledger.enter()


def test_the_rollout_quota_is_reserved_too():
    ledger = _ledger(Budget(), quota=RolloutQuota(message_bytes=1024, call_bytes=4096, rollout_bytes=5000))
    ledger.enter()
    grant = ledger.reserve(None, 3000)
    ledger.enter()
    with pytest.raises(QuotaExceeded, match="rollout_max_bytes") as caught:
        ledger.reserve(None, 3000)
    assert caught.value.http_status == 413 and ledger.finish_reason == "max_bytes"
    ledger.settle(grant)  # it failed: its bytes are free again
    with pytest.raises(QuotaExceeded, match="rollout_message_max_bytes"):
        RolloutQuota(message_bytes=1024).encode([{"role": "user", "content": "x" * 2000}])


def test_the_trainer_sets_the_distribution_the_harness_only_caps_and_stops():
    authority = SamplingAuthority({"temperature": 0.7, "max_tokens": 100, "tool_choice": "required"})
    asked = SamplingParams.model_validate({"temperature": 0.0, "top_k": 1, "seed": 3, "max_tokens": 500,
                                           "stop": ["END"], "logit_bias": {"5": 100}, "tool_choice": "auto"})
    sampling, dropped = authority.effective(asked)
    assert dropped == ["logit_bias", "seed", "temperature", "top_k"]
    assert (sampling.temperature, sampling.top_k, sampling.seed, sampling.max_tokens) == (0.7, 0, None, 100)
    assert sampling.stop == ["END"] and sampling.tool_choice is None and not sampling.model_extra
    lower, _ = authority.effective(SamplingParams.model_validate({"max_tokens": 20, "temperature": 0.7}))
    assert lower.max_tokens == 20 and authority.effective(SamplingParams())[0] is authority.base


def test_a_message_keeps_only_what_a_template_renders():
    body = {"messages": [
        {"role": "user", "content": "hi", "junk": "x" * 100, "source": "model", "call": 0, "token_ids": [1]},
        {"role": "assistant", "content": None, "resent": False, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}", "extra": 1},
             "more": "x"}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok", "cache": 1},
                                                            {"type": "image_url", "image_url": {"url": "x"}}]}],
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}, "x": 1},
                   "junk": 2}]}
    request = OpenAIChat().parse(body)
    assert request.messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "content": [{"type": "text", "text": "ok"}], "tool_call_id": "c1"}]
    assert request.tools == [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    with pytest.raises(BadCall):
        OpenAIChat().parse({"messages": [{"role": "user", "content": {"not": "text"}}]})


def test_only_the_stored_tag_says_which_call_generated_a_message():
    stored = json.loads(tagged(b'{"role":"assistant","content":"x"}', "model", 3))
    assert stored == {"source": "model", "call": 3, "role": "assistant", "content": "x"} and generated_by(stored) == 3
    sent = json.loads(tagged(b'{"role":"assistant","content":"x"}', "caller", 3, resent=True))
    assert sent["resent"] is True and generated_by(sent) is None
    assert generated_by({"role": "assistant", "call": 1}) is None
    assert generated_by({"role": "assistant", "source": "model", "call": True}) is None
