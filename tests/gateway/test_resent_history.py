"""What a harness resends, in process (the gateway session on the fake LLM's own code, no HTTP):
Claude Code's requests as recorded (``fixtures/claude_code_edit.json``), whose third writes the
``Edit`` call's omitted ``replace_all`` in at its schema default. Only defaults differ: the calls
stay one ``exact`` sequence and nothing is re-tokenised. A real change to the call's arguments
re-renders it: a new segment, counted in ``retokenized_calls``."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from prorl_celery.fakes.policy import ScriptedPolicy
from prorl_celery.gateway.apis.anthropic_messages import AnthropicMessages
from prorl_celery.gateway.defaults import filled, tool_defaults
from prorl_celery.gateway.prefix import canonical, tools_key
from prorl_celery.gateway.session import GatewaySession
from prorl_celery.rollout.calllog import CallLog
from prorl_celery.rollout.segments import harness_fields

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "claude_code_edit.json").read_text())
READ = {"file_path": "/tmp/hf-rec/work/calc.py"}
EDIT = {"file_path": "/tmp/hf-rec/work/calc.py", "old_string": "return a - b", "new_string": "return a + b"}
# what the model generates: the calls the recording server answered, Edit without replace_all
SCRIPT = [{"content": "", "tool_calls": [{"name": "Read", "arguments": READ}]},
          {"content": "", "tool_calls": [{"name": "Edit", "arguments": EDIT}]},
          {"content": "Fixed: add() now adds."}]
RECORDED_IDS = ("toolu_01read", "toolu_02edit")  # the recording server's tool_use ids


def _session() -> GatewaySession:
    policy = ScriptedPolicy(SCRIPT, max_model_len=262144)  # Claude Code's ~80 kB prompt, byte tokens
    return GatewaySession("resent", policy.generate, CallLog(sink=None))  # read from the log, never saved


def _replay(edit_input=None) -> dict:
    """The three recorded requests through one session, each history with the ids the gateway
    answered in place of the recording's (and, given, the resent Edit's input changed)."""
    session, api, ids = _session(), AnthropicMessages(), {}
    for messages in RECORDED["messages"]:
        text = json.dumps(messages)
        for recorded, answered in ids.items():
            text = text.replace(recorded, answered)
        messages = json.loads(text)
        for message in messages:
            for block in message["content"] if message["role"] == "assistant" else ():
                if block["name"] == "Edit" and edit_input is not None:
                    block["input"] = edit_input(block["input"])
        request = api.parse({**copy.deepcopy(RECORDED["common"]), "messages": messages})
        turn = session.complete(request, api.name)
        answered = [b["id"] for b in api.respond(turn, request)["content"] if b["type"] == "tool_use"]
        ids.update(zip(RECORDED_IDS[len(ids):], answered))
    return harness_fields(session.calls())


def test_the_recording_resends_the_edit_with_its_default_written_in():
    *_, last = RECORDED["messages"]
    (edit,) = [b for m in last if m["role"] == "assistant" for b in m["content"] if b["name"] == "Edit"]
    assert edit["input"] == {**EDIT, "replace_all": False}
    schema = next(t for t in RECORDED["common"]["tools"] if t["name"] == "Edit")["input_schema"]
    assert schema["properties"]["replace_all"]["default"] is False and "replace_all" not in schema["required"]


def test_an_edit_resent_with_its_schema_default_written_in_stays_exact():
    view = _replay()
    assert view["counts"]["calls"] == 3
    assert view["token_mode"] == "exact" and view["counts"]["segments"] == 1, view["segments"]
    assert view["counts"]["retokenized_calls"] == 0


def test_an_edit_resent_as_it_was_answered_stays_exact_too():
    view = _replay(lambda args: {k: v for k, v in args.items() if k != "replace_all"})
    assert view["token_mode"] == "exact" and view["counts"]["retokenized_calls"] == 0


def test_a_resent_edit_whose_arguments_really_changed_is_re_tokenised_and_counted():
    view = _replay(lambda args: {**args, "replace_all": True})
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
    session, api = _session(), AnthropicMessages()
    session.complete(api.parse({**RECORDED["common"], "messages": RECORDED["messages"][0]}), api.name)
    sub = {**RECORDED["common"], "system": [{"type": "text", "text": "You are a file search specialist."}],
           "messages": [{"role": "user", "content": "Search /repo for callers of add()."}]}
    session.complete(api.parse(sub), api.name)
    view = harness_fields(session.calls())
    assert view["counts"]["segments"] == 2 and view["counts"]["retokenized_calls"] == 0
