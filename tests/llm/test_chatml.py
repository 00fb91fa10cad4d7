"""The byte tokenizer's chat template and the Hermes tool-call parser (``prorl_celery/llm/chatml.py``),
in process: what a model's reply becomes (content, tool calls, whether it was malformed), and a
rendered conversation read back. ``tests/real/test_llamacpp.py`` parses a real model's output with
the same parser."""
from __future__ import annotations

import json

import pytest

from prorl_celery.llm.chatml import IM_END, IM_START, parse, render, split_tool_calls, text_of

pytestmark = pytest.mark.unit


def block(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


def test_each_well_formed_block_is_a_call_and_the_text_around_them_is_the_content():
    text = ("Let me look." + block('{"name": "bash", "arguments": {"command": "ls -a"}}')
            + " then " + block('{"name": "submit", "arguments": "{\\"answer\\": \\"4\\"}"}'))
    content, calls, malformed = split_tool_calls(text)
    assert (content, malformed) == ("Let me look. then ", False)
    assert [(c.name, c.args()) for c in calls] == [("bash", {"command": "ls -a"}), ("submit", {"answer": "4"})]
    assert calls[1].arguments == '{"answer": "4"}'  # arguments given as a string stay as written
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("text", [
    block("{not json"),
    block('{"arguments": {"command": "ls"}}'),  # no name
    block('["bash", "ls"]'),
    "Running it: <tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"ls\"}}",  # never closed
])
def test_a_malformed_or_unclosed_block_is_flagged_and_gives_no_call(text):
    content, calls, malformed = split_tool_calls(text)
    assert malformed is True and calls == []


def test_one_bad_block_beside_a_good_one_keeps_the_good_call_and_flags_the_reply():
    _, calls, malformed = split_tool_calls(block("{oops") + block('{"name": "bash", "arguments": {}}'))
    assert malformed is True and [c.name for c in calls] == ["bash"] and calls[0].args() == {}


def test_a_call_without_arguments_has_empty_ones():
    _, [call], malformed = split_tool_calls(block('{"name": "submit"}'))
    assert (call.name, call.arguments, call.args(), malformed) == ("submit", "{}", {}, False)


def test_a_rendered_conversation_reads_back_with_its_tool_calls():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "List "}, {"type": "text", "text": "files"}]},
                {"role": "assistant", "content": "Sure.",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
                {"role": "tool", "content": "a.txt\n"}]
    text = render(messages, add_generation_prompt=False)
    assert text.count(IM_START) == 4 and text.count(IM_END) == 4 and not text.endswith(f"{IM_START}assistant\n")
    back = parse(text + f"{IM_START}assistant\n")  # the open generation prompt is not a message
    assert [(m["role"], m["content"]) for m in back] == [("system", "Be brief."), ("user", "List files"),
                                                        ("assistant", "Sure."), ("tool", "a.txt\n")]
    [call] = back[2]["tool_calls"]
    assert call["function"]["name"] == "bash" and json.loads(call["function"]["arguments"]) == {"command": "ls"}


def test_tools_are_listed_in_the_system_message_or_one_of_their_own():
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    with_system = parse(render([{"role": "system", "content": "Hi."}, {"role": "user", "content": "x"}], tools))
    assert with_system[0]["content"].startswith("Hi.\n\n# Tools\n<tools>\n") and '"name": "bash"' in \
        with_system[0]["content"]
    without = parse(render([{"role": "user", "content": "x"}], tools))
    assert [m["role"] for m in without] == ["system", "user"] and without[0]["content"].startswith("# Tools")


def test_content_parts_and_none_are_plain_text():
    assert text_of(None) == "" and text_of("a") == "a"
    assert text_of([{"type": "text", "text": "a"}, {"type": "image_url"}, "junk", {"text": "b"}]) == "ab"
