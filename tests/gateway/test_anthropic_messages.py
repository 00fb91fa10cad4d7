"""Anthropic Messages through the session gateway, with the real ``anthropic`` client: tool use
round trips (plain and streamed) whose recorded ids are the server's and whose calls chain;
count_tokens; failures in Anthropic's error shape."""
from __future__ import annotations

import importlib.util

import pytest
import requests

from prorl_celery.rollout.segments import continued, merged, prompts
from tests.gateway.test_openai_chat import _gateway, stored
from tests.llm.conftest import add

if importlib.util.find_spec("anthropic") is None:
    pytest.skip("the 'anthropic' package is not installed", allow_module_level=True)
TOOLS = [{"name": "bash", "description": "run a command",
          "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]
SYSTEM = "You are an agent."
FIRST = [{"role": "user", "content": [{"type": "text", "text": "List the files."}]}]


def _sdk():
    """The ``anthropic`` package, imported when a test runs: importing it takes seconds, which
    every collection of the suite (``-m unit`` too) paid when it was imported here."""
    import anthropic

    return anthropic


def _client(gw):
    return _sdk().Anthropic(base_url=gw.url, api_key=gw.token, max_retries=0)


def _loop(client, stream: bool) -> list:
    messages, answers = list(FIRST), []
    for k in range(3):
        kwargs = {"model": "m", "max_tokens": 200, "system": SYSTEM, "messages": messages, "tools": TOOLS}
        if stream:
            with client.messages.stream(**kwargs) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**kwargs)
        answers.append(message)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": f"result {k}"}
                   for b in message.content if b.type == "tool_use"]
        if results:
            messages.append({"role": "user", "content": results})
    return answers


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trips_chain_on_the_servers_ids(fake_llms, pool, redis_conn, script, stream):
    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    add(pool, proc, protocol="generate")
    with _gateway(pool, redis_conn) as gw:
        answers = _loop(_client(gw), stream)
    records, _ = stored(gw, redis_conn)
    assert [a.stop_reason for a in answers] == ["tool_use", "tool_use", "end_turn"]
    first = answers[0]
    assert first.content[0].type == "text" and first.content[0].text == "Let me look."
    assert first.content[1].type == "tool_use" and first.content[1].input == {"cmd": "ls"}
    assert answers[2].content[0].text == "Done: the answer is 42."
    served = [r for r in proc.received() if r["status"] == "ok"]
    assert [r.response_ids for r in records] == [s["response_ids"] for s in served]
    assert prompts(records) == [s["prompt_ids"] for s in served]
    assert [continued(r) for r in records] == [False, True, True] and len(merged(records)) == 1
    assert answers[0].usage.input_tokens == len(served[0]["prompt_ids"])


def test_count_tokens_and_errors_in_anthropic_shape(fake_llms, pool, redis_conn, script):
    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    add(pool, proc, protocol="generate", max_model_len=600)
    with _gateway(pool, redis_conn) as gw:
        client = _client(gw)
        counted = client.messages.count_tokens(model="m", system=SYSTEM, messages=FIRST, tools=TOOLS)
        made = client.messages.create(model="m", max_tokens=50, system=SYSTEM, messages=FIRST, tools=TOOLS)
        assert counted.input_tokens == made.usage.input_tokens > 0
        with pytest.raises(_sdk().BadRequestError, match="prompt is too long"):
            client.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "x" * 2000}])
        with pytest.raises(_sdk().AuthenticationError):
            _sdk().Anthropic(base_url=gw.url, api_key="wrong", max_retries=0).messages.create(
                model="m", max_tokens=5, messages=FIRST)
        bad = requests.post(gw.url + "/v1/messages", headers={"x-api-key": gw.token},
                            json={"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert bad.json()["type"] == "error"
