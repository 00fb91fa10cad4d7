"""What a harness resends, in process (the gateway session on the fake LLM's own code, no HTTP):
Claude Code's recorded request shape, whose second request writes the ``Edit`` call's omitted
``replace_all`` in at its schema default. Only defaults differ: the calls stay one ``exact``
sequence and nothing is re-tokenised. A real change to the call's arguments re-renders it: a
new segment, counted in ``retokenized_calls``."""
from __future__ import annotations

import copy
import json

import pytest

from prorl_celery.fakes.policy import ScriptedPolicy
from prorl_celery.gateway.apis.anthropic_messages import AnthropicMessages
from prorl_celery.gateway.defaults import filled, tool_defaults
from prorl_celery.gateway.prefix import canonical, tools_key
from prorl_celery.gateway.session import GatewaySession
from prorl_celery.rollout.calllog import CallLog
from prorl_celery.rollout.segments import harness_fields

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

# Claude Code's Read and Edit tools as its requests carry them (descriptions shortened)
SCHEMA = "http://json-schema.org/draft-07/schema#"
READ = {"name": "Read", "description": "Reads a file from the local filesystem.",
        "input_schema": {"type": "object", "properties": {
            "file_path": {"type": "string", "description": "The absolute path to the file to read"},
            "offset": {"type": "number", "description": "The line number to start reading from."},
            "limit": {"type": "number", "description": "The number of lines to read."}},
            "required": ["file_path"], "additionalProperties": False, "$schema": SCHEMA}}
EDIT = {"name": "Edit", "description": "Performs exact string replacements in files.",
        "input_schema": {"type": "object", "properties": {
            "file_path": {"type": "string", "description": "The absolute path to the file to modify"},
            "old_string": {"type": "string", "description": "The text to replace"},
            "new_string": {"type": "string", "description": "The text to replace it with"},
            "replace_all": {"type": "boolean", "default": False,
                            "description": "Replace all occurences of old_string (default false)"}},
            "required": ["file_path", "old_string", "new_string"], "additionalProperties": False,
            "$schema": SCHEMA}}
EDIT_ARGS = {"file_path": "/repo/calc.py", "old_string": "a - b", "new_string": "a + b"}
SCRIPT = [{"content": "", "tool_calls": [{"name": "Read", "arguments": {"file_path": "/repo/calc.py"}}]},
          {"content": "", "tool_calls": [{"name": "Edit", "arguments": EDIT_ARGS}]},
          {"content": "Fixed: add() now adds."}]


def _body(messages: list[dict]) -> dict:
    """A request as Claude Code sends it: system blocks with cache control, tools, metadata, stream."""
    return {"model": "claude-sonnet-4-5-20250929", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                        "cache_control": {"type": "ephemeral"}}],
            "messages": messages, "tools": [READ, EDIT], "metadata": {"user_id": "user_0_session_1"}}


def _session() -> tuple[GatewaySession, ScriptedPolicy]:
    policy = ScriptedPolicy(SCRIPT)
    log = CallLog(sink=None)  # never flushed: the test reads the calls from the log
    return GatewaySession("resent", policy.generate, log), policy


def _run(resend_edit) -> dict:
    """Three calls, each history as Claude Code resends it; ``resend_edit`` makes the Edit
    tool_use input it resends out of the one the gateway answered."""
    session, _ = _session()
    api = AnthropicMessages()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nAs you answer, use the tools.\n</system-reminder>"},
        {"type": "text", "text": "add() in /repo/calc.py subtracts; fix it.", "cache_control": {"type": "ephemeral"}}]}]
    for k in range(3):
        request = api.parse(_body(copy.deepcopy(messages)))
        turn = session.complete(request, api.name)
        blocks = api.respond(turn, request)["content"]
        if not any(b["type"] == "tool_use" for b in blocks):
            break
        resent = [resend_edit(b) if b["type"] == "tool_use" and b["name"] == "Edit" else b for b in blocks]
        messages.append({"role": "assistant", "content": resent})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b["id"], "content": f"result {k}"}
            for b in blocks if b["type"] == "tool_use"]})
    return harness_fields(session.calls())


def _with_input(block: dict, **changed) -> dict:
    return {**block, "input": {**block["input"], **changed}}


def test_an_edit_resent_with_its_schema_default_written_in_stays_exact():
    view = _run(lambda b: _with_input(b, replace_all=False))
    assert view["counts"]["calls"] == 3
    assert view["token_mode"] == "exact" and view["counts"]["segments"] == 1, view["segments"]
    assert view["counts"]["retokenized_calls"] == 0


def test_an_edit_resent_as_it_was_answered_stays_exact_too():
    view = _run(lambda b: b)
    assert view["token_mode"] == "exact" and view["counts"]["retokenized_calls"] == 0


def test_a_resent_edit_whose_arguments_really_changed_is_re_tokenised_and_counted():
    view = _run(lambda b: _with_input(b, replace_all=True))
    assert view["token_mode"] == "segmented" and view["counts"]["segments"] == 2
    assert [seg["reason"] for seg in view["segments"]] == ["first", "not_a_prefix"]
    assert view["counts"]["retokenized_calls"] == 1  # the third call re-rendered the second's answer


def test_defaults_fill_nested_objects_and_arrays_on_both_sides():
    tools = [{"type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": {
        "flag": {"type": "boolean", "default": False},
        "opts": {"type": "object", "properties": {"depth": {"type": "integer", "default": 1},
                                                   "mode": {"type": "string"}}},
        "edits": {"type": "array", "items": {"type": "object", "properties": {
            "all": {"type": "boolean", "default": False}, "old": {"type": "string"}}}}}}}}]
    defaults = tool_defaults(tools_key(tools))
    assert filled({"opts": {"mode": "x"}, "edits": [{"old": "a"}]}, defaults["t"]) == {
        "flag": False, "opts": {"mode": "x", "depth": 1}, "edits": [{"old": "a", "all": False}]}

    def message(args: dict) -> dict:
        return {"role": "assistant", "content": "",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "t", "arguments": json.dumps(args)}}]}

    omitted = message({"opts": {"mode": "x"}, "edits": [{"old": "a"}]})
    written = message({"flag": False, "opts": {"mode": "x", "depth": 1}, "edits": [{"old": "a", "all": False}]})
    other = message({"opts": {"mode": "x", "depth": 2}, "edits": [{"old": "a"}]})
    assert canonical(omitted, defaults) == canonical(written, defaults)
    assert canonical(omitted, defaults) != canonical(other, defaults)
    assert canonical(omitted) != canonical(written)  # without the tools' defaults they differ


def test_a_new_conversation_starts_a_segment_but_re_tokenises_nothing():
    """A sub-agent's first call (its own system prompt and task, no assistant turn yet) cannot
    extend the running sequence, yet no generated turn was rendered from text: 0."""
    session, _ = _session()
    api = AnthropicMessages()
    first = [{"role": "user", "content": "add() in /repo/calc.py subtracts; fix it."}]
    session.complete(api.parse(_body(first)), api.name)
    sub = {**_body([{"role": "user", "content": "Search /repo for callers of add()."}]),
           "system": [{"type": "text", "text": "You are a file search specialist."}]}
    session.complete(api.parse(sub), api.name)
    view = harness_fields(session.calls())
    assert view["counts"]["segments"] == 2 and view["counts"]["retokenized_calls"] == 0
