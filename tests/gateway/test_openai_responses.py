"""OpenAI Responses through the session gateway, with the real ``openai`` client: function calls
round trip (plain and streamed) with the server's own ids recorded and the calls chained; the
caller's whole input each time (no stored responses); failures in OpenAI's shape."""
from __future__ import annotations

import pytest
import requests

from prorl_celery.rollout.segments import continued, merged, prompts
from tests.gateway.test_openai_chat import _client, _gateway, stored
from tests.llm.conftest import add

TOOLS = [{"type": "function", "name": "bash", "description": "run a command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


def _loop(client, stream: bool) -> list:
    items, answers = [{"role": "user", "content": "List the files."}], []
    for k in range(3):
        kwargs = {"model": "m", "instructions": "You are an agent.", "input": items, "tools": TOOLS}
        if stream:
            with client.responses.stream(**kwargs) as events:
                response = events.get_final_response()
        else:
            response = client.responses.create(**kwargs)
        answers.append(response)
        for item in response.output:
            items.append(item.model_dump(exclude_none=True))
            if item.type == "function_call":
                items.append({"type": "function_call_output", "call_id": item.call_id, "output": f"result {k}"})
    return answers


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_round_trip_on_the_servers_ids(fake_llms, pool, redis_conn, script, stream):
    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    add(pool, proc, protocol="generate")
    with _gateway(pool, redis_conn) as gw:
        answers = _loop(_client(gw), stream)
    records, _ = stored(gw, redis_conn)
    first = answers[0]
    assert [i.type for i in first.output] == ["message", "function_call"]
    assert first.output_text == "Let me look." and first.output[1].arguments == '{"cmd": "ls"}'
    assert answers[2].output_text == "Done: the answer is 42." and answers[2].status == "completed"
    served = [r for r in proc.received() if r["status"] == "ok"]
    assert [r.response_ids for r in records] == [s["response_ids"] for s in served]
    assert prompts(records) == [s["prompt_ids"] for s in served]
    assert [continued(r) for r in records] == [False, True, True] and len(merged(records)) == 1


def test_stored_responses_are_refused_in_openai_shape(fake_llms, pool, redis_conn, script):
    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    add(pool, proc, protocol="generate")
    with _gateway(pool, redis_conn) as gw:
        resp = requests.post(gw.url + "/v1/responses", headers={"Authorization": f"Bearer {gw.token}"},
                             json={"model": "m", "input": "hi", "previous_response_id": "resp_1"}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "previous_response_id"
