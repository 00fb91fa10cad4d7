"""Clients against the fake server: token fidelity in token mode, tool calls and server token ids
in chat mode, the context window, and the byte tokenizer's template."""
from __future__ import annotations


import pytest

from prorl_celery.errors import ContextWindowExceeded
from prorl_celery.llm import BackendStatus, LLMRequest, Protocol, SamplingParams
from prorl_celery.llm.tokenizer import ByteTokenizer, continuation_ids, turn_closing_ids
from tests.llm.conftest import TOOLS, add, tool_rollout

def test_token_mode_sends_previous_ids_plus_new_tokens(pool, fake_llms, script):
    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    add(pool, proc, protocol="generate", weight_version="step-7")
    tok = ByteTokenizer()
    turns, messages = tool_rollout(pool, "tok")
    received = [r["prompt_ids"] for r in proc.received()]
    assert received == [t.prompt_ids for t in turns]
    assert received[0] == tok.apply_chat_template(messages[:2], tools=TOOLS)
    for k in (1, 2):
        before = turns[k - 1]
        new = [{"role": "tool", "tool_call_id": "x", "content": f"out {k - 1}\n"}]
        expected = before.prompt_ids + before.response_ids + [ord("\n")] + continuation_ids(tok, new, TOOLS)
        assert received[k] == expected  # exactly: the history is never re-tokenised
    assert [r["response_ids"] for r in proc.received()] == [t.response_ids for t in turns]
    first, second, last = turns
    assert first.protocol is Protocol.GENERATE and first.token_source == "local"
    assert [c.name for c in first.tool_calls] == ["bash"] and first.tool_calls[0].args() == {"cmd": "ls"}
    assert first.content == "Let me look." and second.tool_calls[0].args() == {"cmd": "cat a.txt"}
    assert last.content == "Done: the answer is 42." and not last.tool_calls
    assert all(len(t.logprobs) == len(t.response_ids) for t in turns)
    assert all(t.weight_version == "step-7" and t.backend_id for t in turns)


def test_token_mode_after_a_length_cut_closes_the_turn(pool, fake_llms):
    (proc,) = fake_llms(1)
    add(pool, proc, protocol="generate")
    messages = [{"role": "user", "content": "a long question"}]
    cut = pool.generate("cut", LLMRequest(messages=messages, sampling=SamplingParams(max_tokens=5)))
    assert cut.finish_reason == "length" and cut.format_error == "length" and len(cut.response_ids) == 5
    messages = messages + [cut.message, {"role": "user", "content": "go on"}]
    nxt = pool.generate("cut", LLMRequest(messages=messages, previous=cut))
    im_end = ByteTokenizer.SPECIAL["<|im_end|>"]
    glue = len(cut.prompt_ids) + 5
    assert nxt.prompt_ids[:glue] == cut.prompt_ids + cut.response_ids
    assert nxt.prompt_ids[glue:glue + 2] == [im_end, ord("\n")]  # the template's end of turn, added
    assert proc.received()[-1]["prompt_ids"] == nxt.prompt_ids


def test_chat_mode_tool_calls_token_ids_and_logprobs(pool, fake_llms, script):
    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    bid = add(pool, proc, weight_version="w1")
    messages = [{"role": "user", "content": "Find it"}]
    turn = pool.generate("chat", LLMRequest(messages=messages, tools=TOOLS))
    assert turn.protocol is Protocol.CHAT and turn.backend_id == bid and turn.weight_version == "w1"
    assert turn.finish_reason == "tool_calls" and turn.content == "Let me look."
    assert [(c.name, c.args()) for c in turn.tool_calls] == [("bash", {"cmd": "ls"})]
    assert turn.message["tool_calls"][0]["function"]["name"] == "bash"
    sent = proc.received()[-1]
    assert turn.token_source == "server" and turn.prompt_ids == sent["prompt_ids"]
    assert turn.response_ids == sent["response_ids"] and len(turn.logprobs) == len(turn.response_ids)
    assert turn.model == "prorl-fake-byte"  # discovered from /v1/models


def test_context_window_is_a_typed_error_not_a_backend_failure(pool, fake_llms):
    small, tiny = fake_llms(2, extra=["--max-model-len", "64"])
    chat_id = add(pool, small)
    long = [{"role": "user", "content": "x" * 100}]
    with pytest.raises(ContextWindowExceeded) as err:
        pool.generate("ctx", LLMRequest(messages=long))
    assert "maximum context length is 64" in str(err.value)
    pool.registry.remove(chat_id)
    gen_id = add(pool, tiny, protocol="generate", max_model_len=64)
    with pytest.raises(ContextWindowExceeded):  # checked before sending: nothing left to generate
        pool.generate("ctx", LLMRequest(messages=long))
    assert tiny.received() == []
    fits = pool.generate("ctx", LLMRequest(messages=[{"role": "user", "content": "y" * 20}],
                                           sampling=SamplingParams(max_tokens=1000)))
    assert len(fits.prompt_ids) + len(fits.response_ids) <= 64  # max_tokens clipped to the room left
    backend = pool.registry.get(gen_id)
    assert backend.status is BackendStatus.ACTIVE and backend.failures == 0 and backend.in_flight == 0


@pytest.mark.unit
def test_byte_tokenizer_continuation_matches_a_full_render():
    tok = ByteTokenizer()
    history = [{"role": "user", "content": "héllo"},
               {"role": "assistant", "content": "hi", "tool_calls": [
                   {"id": "1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]}]
    new = [{"role": "tool", "content": "a\nb"}, {"role": "user", "content": "next"}]
    prompt = tok.apply_chat_template(history[:1], tools=TOOLS)
    full = tok.apply_chat_template(history + new, tools=TOOLS)
    response = tok.encode('hi<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>')
    rebuilt = prompt + response + turn_closing_ids(tok, response, TOOLS) + continuation_ids(tok, new, TOOLS)
    assert rebuilt == full
    assert tok.decode(tok.encode("a<|im_start|>b ✓")) == "a<|im_start|>b ✓"
