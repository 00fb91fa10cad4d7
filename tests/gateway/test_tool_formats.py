"""Each tool-call format a backend may declare, through the session gateway over real HTTP: the
fake LLM plays a model that writes its calls in that format (its script's replies are the
format's own text), the backend is registered with the format, and a harness loop in OpenAI chat
or Anthropic Messages gets the calls in its own API's shape, sends the results, and the calls
chain on the ids the server generated. A call the model wrote with broken JSON comes back as no
call (the text outside the markup as the answer) and is recorded with ``format_error``."""
from __future__ import annotations

import importlib.util
import json

import pytest

from prorl_celery.rollout.segments import continued, prompts
from prorl_celery.llm import tool_parsers
from prorl_celery.llm.tokenizer import get_tokenizer
from tests.gateway.test_openai_chat import _client, _gateway, _harness_loop, stored
from tests.llm.conftest import add

if importlib.util.find_spec("openai") is None or importlib.util.find_spec("anthropic") is None:
    pytest.skip("the 'openai' and 'anthropic' packages are needed", allow_module_level=True)
FIRST, SECOND = {"cmd": "ls -la"}, {"cmd": 'grep -n "x" a.txt'}


def _script(tmp_path, fmt: str, first: str | None = None):
    parser = tool_parsers.get(fmt)
    lead = "" if fmt in ("llama3_json", "pythonic") else "Let me look. "  # those formats are the whole answer
    turns = [first if first is not None else lead + parser.render([("bash", FIRST)]),
             parser.render([("bash", SECOND)]), "Done: the answer is 42."]
    path = tmp_path / f"{fmt}.json"
    path.write_text(json.dumps(turns))
    return path, turns


def _check_recorded(proc, records, turns):
    served = [r for r in proc.received() if r["status"] == "ok"]
    assert [r.response_ids for r in records] == [s["response_ids"] for s in served]
    assert prompts(records) == [s["prompt_ids"] for s in served]
    assert [continued(r) for r in records] == [False, True, True]
    tok = get_tokenizer(None)
    # what the model wrote, the format's text, is what was recorded (then its end of turn)
    assert [tok.decode(r.response_ids[:-1]) for r in records] == turns


@pytest.mark.parametrize("fmt", sorted(set(tool_parsers.PARSERS) - {"hermes"}))
def test_openai_chat_gets_calls_in_the_declared_format(fake_llms, pool, redis_conn, tmp_path, fmt):
    script, turns = _script(tmp_path, fmt)
    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    add(pool, proc, protocol="generate", tool_parser=fmt)
    with _gateway(pool, redis_conn) as gw:
        answers = _harness_loop(_client(gw))
    records, _ = stored(gw, redis_conn)
    got = [[(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in a.get("tool_calls", [])]
           for a in answers]
    assert got == [[("bash", FIRST)], [("bash", SECOND)], []]
    assert (answers[0].get("content") or "").strip() == ("" if fmt in ("llama3_json", "pythonic") else "Let me look.")
    assert answers[2]["content"] == "Done: the answer is 42."
    assert not any(r.meta["format_error"] for r in records)
    _check_recorded(proc, records, turns)


@pytest.mark.parametrize("fmt", ["mistral", "qwen3_coder"])
def test_anthropic_messages_gets_tool_use_in_the_declared_format(fake_llms, pool, redis_conn, tmp_path, fmt):
    from tests.gateway.test_anthropic_messages import _client as anthropic_client, _loop

    script, turns = _script(tmp_path, fmt)
    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    add(pool, proc, protocol="generate", tool_parser=fmt)
    with _gateway(pool, redis_conn) as gw:
        answers = _loop(anthropic_client(gw), stream=True)
    records, _ = stored(gw, redis_conn)
    assert [a.stop_reason for a in answers] == ["tool_use", "tool_use", "end_turn"]
    assert [[b.input for b in a.content if b.type == "tool_use"] for a in answers] == [[FIRST], [SECOND], []]
    _check_recorded(proc, records, turns)


@pytest.mark.parametrize("fmt,broken", [
    ("mistral", 'Let me look. [TOOL_CALLS][{"name": "bash", "arguments": {"cmd": "ls -la"'),
    ("llama3_json", '{"name": "bash", "parameters": {"cmd": "ls -la}'),
    ("qwen3_coder", "Let me look. <tool_call>\n<function=bash>\n<parameter=cmd>\nls -la\n</function>\n</tool_call>"),
])
def test_a_call_with_broken_markup_is_no_call_and_is_recorded_as_such(fake_llms, pool, redis_conn, tmp_path,
                                                                      fmt, broken):
    script, _ = _script(tmp_path, fmt, first=broken)
    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    add(pool, proc, protocol="generate", tool_parser=fmt)
    with _gateway(pool, redis_conn) as gw:
        client = _client(gw)
        answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}],
                                                tools=[{"type": "function", "function": {"name": "bash", "parameters": {
                                                    "type": "object", "properties": {"cmd": {"type": "string"}}}}}])
    records, _ = stored(gw, redis_conn)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert (choice.message.content or "").strip() in ("", "Let me look.")
    (record,) = records
    assert record.meta["format_error"] == "tool_call"
    assert get_tokenizer(None).decode(record.response_ids[:-1]) == broken  # the model's own text, recorded
