"""Token mode with a genuine Hugging Face tokenizer: a byte-level BPE trained here, saved with a
Qwen/ChatML-style chat template, loaded by path, and used by the client and the fake server alike.
Nothing is downloaded."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from prorl_celery.errors import InvalidRequest
from prorl_celery.llm import BackendStatus, LLMRequest, SamplingParams
from prorl_celery.llm.tokenizer import (HFTokenizer, continuation_ids, get_tokenizer, template_messages,
                                         turn_closing_ids)
from tests.llm.conftest import SCRIPT, TOOLS, add, tool_rollout

# found, not imported: importing transformers takes seconds, which every collection paid (-m unit too)
if not all(importlib.util.find_spec(name) for name in ("transformers", "tokenizers")):
    pytest.skip("the optional 'transformers' package is not installed", allow_module_level=True)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
# Qwen2.5-like: tools listed in the system turn, consecutive tool results share one user turn.
TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nFunction signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if m.content %}{{- m.content }}{%- endif %}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- set f = call.function or call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3-like flaw: the last assistant turn gets an empty think block that it loses once a message
# follows, so what was rendered before the new messages changes.
UNSTABLE = TEMPLATE.replace("{{- '<|im_start|>assistant\\n' }}{%- if m.content %}",
                            "{{- '<|im_start|>assistant\\n' }}{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}"
                            "{%- endif %}{%- if m.content %}")
CORPUS = ["You are an agent. Find it. Let me look. Done: the answer is 42.", "echo: out 0 out 1 a.txt",
          '{"name": "bash", "arguments": {"cmd": "ls"}} {"type": "function", "description": "run a command"}',
          "# Tools\n\nFunction signatures:\n<tools>\n</tools>\n<tool_response>\n</tool_response>\n"]


def build_tokenizer(directory: Path, template: str) -> Path:
    """Train a small byte-level BPE and save it as a ``transformers`` tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS * 10, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL[1:])
    tok.chat_template = template
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(a suffix-stable tokenizer directory, the same tokenizer with an unstable template)."""
    root = tmp_path_factory.mktemp("hf-tokenizer")
    return build_tokenizer(root / "stable", TEMPLATE), build_tokenizer(root / "unstable", UNSTABLE)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local directory only; never the hub


def test_hf_tokenizer_by_path_matches_transformers(hf_dirs):
    stable, unstable = hf_dirs
    tok = get_tokenizer(str(stable))
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(stable)
    assert isinstance(tok, HFTokenizer)
    assert tok.stop_ids == {raw.convert_tokens_to_ids("<|im_end|>"), raw.convert_tokens_to_ids("<|endoftext|>")}
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Find it ✓"}]
    native = raw.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    native = native["input_ids"] if hasattr(native, "keys") else native  # a BatchEncoding in transformers 5
    assert tok.apply_chat_template(messages, tools=TOOLS) == list(native)
    assert tok.decode(tok.encode("a<|im_start|>b ✓ é")) == "a<|im_start|>b ✓ é"

    # A prompt, the reply's ids and the continuation ids make exactly the full render.
    reply = {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]}
    new = [{"role": "tool", "tool_call_id": "1", "content": "a.txt"}, {"role": "tool", "content": "b"},
           {"role": "user", "content": "next"}]
    response = tok.encode('Let me look.<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
                          "<|im_end|>")
    closing = turn_closing_ids(tok, response, TOOLS)
    assert tok.decode(closing) == "\n"
    rebuilt = tok.apply_chat_template(messages, tools=TOOLS) + response + closing + continuation_ids(tok, new, TOOLS)
    assert tok.decode(rebuilt) == raw.apply_chat_template(messages + [reply] + new, tools=TOOLS, tokenize=False,
                                                          add_generation_prompt=True)

    with pytest.raises(InvalidRequest, match="not suffix-stable") as err:
        continuation_ids(get_tokenizer(str(unstable)), new, TOOLS)
    assert "<think>" in str(err.value) and err.value.field == "tokenizer"


def test_token_mode_through_a_fake_server_with_the_same_tokenizer(pool, fake_llms, hf_dirs, tmp_path):
    stable, unstable = hf_dirs
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    (proc,) = fake_llms(1, policy=f"scripted:{script}", extra=["--tokenizer", str(stable)])
    bid = add(pool, proc, protocol="generate", tokenizer=str(stable))
    tok = get_tokenizer(str(stable))
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(stable)
    im_end, newline = tok.encode("<|im_end|>")[0], tok.encode("\n")
    turns, messages = tool_rollout(pool, "hf")
    received = proc.received()
    assert [r["prompt_ids"] for r in received] == [t.prompt_ids for t in turns]
    assert [r["response_ids"] for r in received] == [t.response_ids for t in turns]
    assert received[0]["prompt_ids"] == tok.apply_chat_template(messages[:2], tools=TOOLS)
    for k in (1, 2):
        before, new = turns[k - 1], [{"role": "tool", "tool_call_id": "x", "content": f"out {k - 1}\n"}]
        assert before.response_ids[-1] == im_end and im_end not in before.response_ids[:-1]
        # exactly the previous prompt and response plus the new message's ids: nothing re-tokenised
        assert received[k]["prompt_ids"] == (before.prompt_ids + before.response_ids + newline
                                             + continuation_ids(tok, new, TOOLS))
        # ... and that is the very conversation the template renders
        assert tok.decode(received[k]["prompt_ids"]) == raw.apply_chat_template(
            messages[:2 + 2 * k], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    first, second, last = turns
    assert first.content == "Let me look." and first.tool_calls[0].args() == {"cmd": "ls"}
    assert second.tool_calls[0].args() == {"cmd": "cat a.txt"}
    assert last.content == "Done: the answer is 42." and last.finish_reason == "stop" and not last.tool_calls
    assert all(len(t.logprobs) == len(t.response_ids) for t in turns)

    # Cut by length: the client closes the turn with the template's own end of turn.
    cut = pool.generate("hf-cut", LLMRequest(messages=messages[:2], sampling=SamplingParams(max_tokens=2)))
    assert cut.finish_reason == "length" and len(cut.response_ids) == 2
    follow = [cut.message, {"role": "user", "content": "go on"}]
    nxt = pool.generate("hf-cut", LLMRequest(messages=messages[:2] + follow, previous=cut))
    glue = len(cut.prompt_ids) + 2
    assert nxt.prompt_ids[glue:glue + 2] == [im_end, *newline]
    assert proc.received()[-1]["prompt_ids"] == nxt.prompt_ids

    # A template that is not suffix-stable is refused with the reason, before anything is sent.
    sent = len(proc.received())
    first = pool.generate("hf-bad", LLMRequest(messages=messages[:2], tools=TOOLS, tokenizer=str(unstable)))
    more = messages[:2] + [first.message, {"role": "tool", "content": "out"}]
    with pytest.raises(InvalidRequest, match="not suffix-stable"):
        pool.generate("hf-bad", LLMRequest(messages=more, tools=TOOLS, tokenizer=str(unstable), previous=first))
    assert len(proc.received()) == sent + 1
    backend = pool.registry.get(bid)
    assert backend.status is BackendStatus.ACTIVE and backend.failures == 0 and backend.in_flight == 0


# Templates that take the arguments as an object, as vLLM and SGLang hand them over: Llama-3.1-like
# (``| tojson``, no string case) and Qwen3-Coder-like (``| items``, which needs a mapping).
AS_OBJECT = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.content %}{{- m.content }}{%- endif %}"
    "{%- for call in m.tool_calls or [] %}"
    "{{- '<tool_call>{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- call.function.arguments | tojson }}{{- '}</tool_call>' }}"
    "{%- for key, value in call.function.arguments | items %}{{- '<' + key + '>' }}{%- endfor %}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_tool_call_arguments_reach_the_template_as_an_object(tmp_path):
    tok = get_tokenizer(str(build_tokenizer(tmp_path / "object", AS_OBJECT)))
    call = {"id": "1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls", "n": 2}'}}
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "assistant", "content": "",
                 "tool_calls": [{**call, "function": {"name": "bash", "arguments": ""}}]}]
    text = tok.decode(tok.apply_chat_template(messages))
    assert '"arguments": {"cmd": "ls", "n": 2}}</tool_call><cmd><n>' in text, text
    assert '"arguments": {}}</tool_call><|im_end|>' in text, text  # empty: an empty object
    assert '\\"cmd\\"' not in text  # never the JSON string, quoted again
    # what transformers renders when handed the parsed object, as vLLM's and SGLang's serving do
    from transformers import AutoTokenizer

    parsed = [messages[0], {**messages[1], "tool_calls": [{**call, "function": {"name": "bash",
                                                                               "arguments": {"cmd": "ls", "n": 2}}}]},
              {**messages[2], "tool_calls": [{**call, "function": {"name": "bash", "arguments": {}}}]}]
    raw = AutoTokenizer.from_pretrained(tmp_path / "object")
    assert text == raw.apply_chat_template(parsed, tokenize=False, add_generation_prompt=True)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"cmd": "ls", "n": 2}'  # not changed
    odd = template_messages([{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "not json"}}, {"function": {"name": "f", "arguments": "[1]"}}]}])
    assert [c["function"]["arguments"] for c in odd[0]["tool_calls"]] == ["not json", "[1]"]  # as written
