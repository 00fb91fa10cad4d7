"""The tool-call formats a backend may declare (``prorl_celery/llm/tool_parsers.py``), in
process: each reads back what it renders, reads the other spellings its models use, and flags
call markup it cannot read (malformed JSON, an unclosed block) without losing the calls around
it. The gateway's round trips of each format through a fake model are in
``tests/gateway/test_tool_formats.py``."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from prorl_celery.llm import tool_parsers
from prorl_celery.llm.models import BackendSpec

pytestmark = pytest.mark.unit
TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "opts": {"type": "object"}, "text": {"type": "string"}}}}}]
CALLS = [("edit", {"path": "a.py", "line": 3, "opts": {"dry": True}, "text": 'x = "1"\n'}),
         ("edit", {"path": "b.py", "line": 0, "opts": {}, "text": "{not json"})]


def _read(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", sorted(tool_parsers.PARSERS))
def test_each_format_reads_back_what_it_renders(name):
    parser = tool_parsers.PARSERS[name]
    text = parser.render(CALLS)
    assert parser.marker(text)
    content, calls, malformed = parser.split(text, TOOLS)
    assert _read(calls) == [(n, a) for n, a in CALLS] and not malformed
    assert content.strip() == ""
    assert len({c.id for c in calls}) == 2
    plain = "The answer is 42."
    assert parser.split(plain, TOOLS) == (plain, [], False)


def test_other_spellings_of_the_formats():
    _, calls, bad = tool_parsers.get("llama3_json").split(
        '<|python_tag|>{"name": "edit", "arguments": {"path": "x"}}; {"name": "edit", "parameters": {}}', TOOLS)
    assert _read(calls) == [("edit", {"path": "x"}), ("edit", {})] and not bad
    content, calls, bad = tool_parsers.get("mistral").split(
        'Fixing.[TOOL_CALLS]edit[ARGS]{"path": "x", "line": 2}[TOOL_CALLS]edit[CALL_ID]a1b2c3d4e[ARGS]{}', TOOLS)
    assert content == "Fixing." and _read(calls) == [("edit", {"path": "x", "line": 2}), ("edit", {})] and not bad
    # qwen3_coder: values typed by the tool's schema (a string stays text even when it looks like JSON)
    _, [call], bad = tool_parsers.get("qwen3_coder").split(
        "<tool_call>\n<function=edit>\n<parameter=line>\n7\n</parameter>\n<parameter=text>\n12\n</parameter>\n"
        "<parameter=other>[1]</parameter>\n</function>\n</tool_call>", TOOLS)
    assert call.args() == {"line": 7, "text": "12", "other": "[1]"} and not bad
    content, [call], bad = tool_parsers.get("pythonic").split(
        "Sure.<|python_start|>[edit(path='a', line=-1, opts={'k': [1, None]})]<|python_end|>", TOOLS)
    assert content == "Sure." and call.args() == {"path": "a", "line": -1, "opts": {"k": [1, None]}}


@pytest.mark.parametrize("name,text,good", [
    ("hermes", '<tool_call>{"name": "edit", "arguments": {"path": </tool_call><tool_call>{"name": "edit"}</tool_call>', 1),
    ("llama3_json", '{"name": "edit", "parameters": {"path": "a"}}; {"name": "edit", "parameters": {"pa', 1),
    ("llama3_json", '<|python_tag|>[1, 2]', 0),
    ("mistral", '[TOOL_CALLS][{"name": "edit", "arguments": {"path": "a"}}, {"name": ', 0),
    ("mistral", '[TOOL_CALLS]edit[ARGS]{"path": "a"}[TOOL_CALLS]edit[ARGS]{"path": ', 1),
    ("mistral", '[TOOL_CALLS]edit{"path": "a"}', 0),
    ("qwen3_coder", "<tool_call><function=edit><parameter=path>a</parameter></function></tool_call>"
                    "<tool_call><function=edit><parameter=path>a</function></tool_call>", 1),
    ("qwen3_coder", "Fixing. <tool_call><function=edit><parameter=path>a</parameter>", 0),
    ("pythonic", "[edit(path='a'), edit(path=open('x'))]", 0),
    ("pythonic", "[edit(path='a'", 0),
])
def test_unreadable_call_markup_is_flagged_and_readable_calls_kept(name, text, good):
    content, calls, malformed = tool_parsers.get(name).split(text, TOOLS)
    assert malformed and len(calls) == good
    assert "edit" not in content  # no half-read call left in the text shown as the answer


def test_without_tools_only_hermes_reads_calls():
    text = '{"name": "edit", "parameters": {}}'
    assert tool_parsers.split("llama3_json", text, None) == (text, [], False)
    assert tool_parsers.split("llama3_json", text, TOOLS)[1]
    assert tool_parsers.split(None, '<tool_call>{"name": "edit", "arguments": {}}</tool_call>', None)[1]


def test_a_backend_declares_a_known_format_or_is_refused_naming_the_field():
    assert BackendSpec(address="http://x:1", tool_parser="mistral").tool_parser == "mistral"
    assert BackendSpec(address="http://x:1").tool_parser is None  # hermes
    with pytest.raises(ValidationError) as info:
        BackendSpec(address="http://x:1", tool_parser="gpt-99")
    (error,) = info.value.errors()
    assert error["loc"] == ("tool_parser",) and "hermes" in error["msg"]
