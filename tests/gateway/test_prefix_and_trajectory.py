"""In process (no Redis, no HTTP): which earlier call a conversation continues, how calls (rollout
store records) rebuild their prompts and merge into segments."""
from __future__ import annotations

import pytest

from prorl_celery.gateway.prefix import Seen, canonical, find_base, tools_key
from prorl_celery.rollout.segments import harness_fields, merged, per_call, prompts
from prorl_celery.llm.models import Protocol, ToolCall, Turn
from prorl_celery.rollout.store import Call

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

SYS = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


def _turn(prompt, response, content="", calls=()) -> Turn:
    return Turn(backend_id="b", address="a", weight_version="v", protocol=Protocol.GENERATE, model="m",
                content=content, tool_calls=[ToolCall(id=f"c{i}", name=n, arguments=a) for i, (n, a) in enumerate(calls)],
                prompt_ids=prompt, response_ids=response, logprobs=[-0.5] * len(response), message_count=len(SYS))


def _base(history, messages, tools):
    return find_base(history, messages, tools)[0]


def _seen(index, messages, turn, tools=None) -> Seen:
    return Seen(index, [canonical(m) for m in messages], tools_key(tools), turn)


def test_a_continuation_is_found_despite_reserialised_arguments_and_content_parts():
    turn = _turn([1, 2], [3, 4], content="look", calls=[("bash", '{"cmd": "ls",  "n": 1}')])
    history = [_seen(0, SYS, turn)]
    echoed = {"role": "assistant", "content": [{"type": "text", "text": "look"}],
              "tool_calls": [{"id": "x", "type": "function", "function": {"name": "bash", "arguments": '{"n":1,"cmd":"ls"}'}}]}
    assert _base(history, [*SYS, echoed, {"role": "tool", "content": "out"}], None) is history[0]
    # the model's answer edited, other tools, or a different history: not a continuation
    edited = {**echoed, "tool_calls": [{"function": {"name": "bash", "arguments": '{"cmd": "rm"}'}}]}
    assert _base(history, [*SYS, edited, {"role": "tool", "content": "out"}], None) is None
    assert _base(history, [*SYS, echoed], [{"type": "function", "function": {"name": "bash"}}]) is None
    assert _base(history, [SYS[0], {"role": "user", "content": "other"}, echoed], None) is None


def test_the_longest_continued_history_wins():
    a = _seen(0, SYS, _turn([1], [2], content="a"))
    b_msgs = [*SYS, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
    b = _seen(1, b_msgs, _turn([1, 2, 9], [3], content="b"))
    convo = [*b_msgs, {"role": "assistant", "content": "b"}, {"role": "user", "content": "again"}]
    assert _base([a, b], convo, None) is b and _base([b, a], convo, None) is b


def _rec(i, keep, new, response, continued=True) -> Call:
    """A stored record: ``keep`` ids of the last call's prompt + response, then ``new``."""
    return Call(keep, new, response, [-1.0] * len(response), {"weight_version": f"w{i}",
                                                                "gateway": {"continued": continued}})


def test_prompts_are_rebuilt_and_merged_with_masks_and_segments():
    records = [_rec(0, 0, [1, 2, 3], [4, 5], continued=False),
               _rec(1, 5, [6], [7]),                          # [1..5] + [6] -> extends
               _rec(2, 2, [8, 8], [9], continued=False),      # a compacted history: [1, 2, 8, 8]
               _rec(3, 5, [10], [11])]
    assert prompts(records) == [[1, 2, 3], [1, 2, 3, 4, 5, 6], [1, 2, 8, 8], [1, 2, 8, 8, 9, 10]]
    first, second = merged(records)
    assert first["calls"] == [0, 1] and first["reason"] == "first"
    assert first["prompt_ids"] == [1, 2, 3] and first["response_ids"] == [4, 5, 6, 7]
    assert first["loss_mask"] == [1, 1, 0, 1] and first["logprobs"] == [-1.0, -1.0, 0.0, -1.0]
    assert first["weight_versions"] == ["w0", "w1"]
    assert second["calls"] == [2, 3] and second["reason"] == "not_a_prefix"
    assert second["response_ids"] == [9, 10, 11] and second["loss_mask"] == [1, 0, 1]
    view = harness_fields(records)
    assert view["token_mode"] == "segmented" and view["tokens"]["response_ids"] == [4, 5, 6, 7]
    assert view["counts"] == {"calls": 4, "segments": 2, "masked_tokens": 2, "generated_tokens": 5,
                              "retokenized_calls": 1, "stale_masked_tokens": 0}
    # calls the staleness fence masked keep their ids, loss mask 0, counted apart
    fenced = harness_fields(records, [1, 3])
    assert [seg["loss_mask"] for seg in fenced["segments"]] == [[1, 1, 0, 0], [1, 0, 0]]
    assert fenced["counts"]["stale_masked_tokens"] == 2 and fenced["counts"]["masked_tokens"] == 4
    assert [t["loss_mask"] for t in per_call(records, [1, 3])] == [[1, 1], [0], [1], [0]]
    assert [t["prompt_ids"] for t in per_call(records)] == prompts(records)
    assert harness_fields([])["token_mode"] == "none"
    # packed and read back as the store does: the same
    assert prompts([Call.unpack(c.pack()) for c in records]) == prompts(records)
