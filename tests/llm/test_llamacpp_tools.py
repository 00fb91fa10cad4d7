"""The llama.cpp chat dialect forces a tool call with its own grammar (see
prorl_celery/llm/dialects/llamacpp_tools.py); the real server's acceptance is in tests/real/test_llamacpp.py."""
from __future__ import annotations

import pytest

from tasks.agent.tools import BASH, EDITOR, SUBMIT
from prorl_celery.llm.clients.chat import chat_body
from prorl_celery.llm.dialects.llamacpp_tools import forced_call, requested_names, tool_call_grammar
from prorl_celery.llm.models import LLMRequest, Protocol, SamplingParams
from prorl_celery.llm.routing import Slot

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

TOOLS = [BASH, EDITOR, SUBMIT]


def _body(dialect: str, tool_choice) -> dict:
    slot = Slot.direct(backend_id="b", address="http://x", protocol=Protocol.CHAT, dialect=dialect)
    request = LLMRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                         sampling=SamplingParams(tool_choice=tool_choice))
    return chat_body(slot, request, "m")


def test_required_goes_as_a_grammar_with_tool_choice_none():
    body = _body("llama.cpp", "required")
    assert body["tool_choice"] == "none" and body["tools"] == TOOLS and body["parallel_tool_calls"] is False
    grammar = body["grammar"]
    assert grammar.startswith("root ::= call0 | call1 | call2\n")
    for name in ("bash", "str_replace_editor", "submit"):
        assert f'\\"name\\": \\"{name}\\"' in grammar


def test_a_named_function_allows_only_that_one():
    body = _body("llama.cpp", {"type": "function", "function": {"name": "submit"}})
    assert body["grammar"].startswith("root ::= call0\n") and '\\"submit\\"' in body["grammar"]
    assert '\\"bash\\"' not in body["grammar"]
    assert requested_names(TOOLS, {"type": "function", "function": {"name": "nope"}}) is None


def test_auto_none_and_other_dialects_are_left_alone():
    for choice in ("auto", "none", None):
        body = _body("llama.cpp", choice)
        assert "grammar" not in body and body.get("tool_choice") == choice
    assert forced_call(None, "required") == {}
    body = _body("vllm", "required")
    assert body["tool_choice"] == "required" and "grammar" not in body


def test_arguments_follow_the_schema():
    grammar = tool_call_grammar(TOOLS, ["bash", "str_replace_editor", "submit"])
    bash, editor, submit = (line for line in grammar.splitlines() if line.startswith("call"))
    # bash: command (required, a string) first, then the optional timeout as an integer
    assert '"{\\"command\\": " string ( "," ws ( "\\"timeout\\"" ws ":" ws integer ) )* "}"' in bash
    # the editor's command is its enum; path a string
    assert '( "\\"view\\"" | "\\"create\\""' in editor and '", \\"path\\": " string' in editor
    # submit has no required argument: any of its keys, or none
    assert '"{" ws ( ( "\\"answer\\"" ws ":" ws string )' in submit
    # a schema the grammar does not model: any JSON object
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "array"}}}
    assert 'call0 ::= "<tool_call>\\n{\\"name\\": \\"odd\\", \\"arguments\\": " object ' in tool_call_grammar([odd], ["odd"])
