"""Record real llama.cpp answers once into tests/fixtures/recorded/llamacpp/ (the fake server's
dialects are built from them): ``python -m tests.real.record_llamacpp JINJA_URL NO_JINJA_URL``,
both servers started by ``python -m prorl_celery.llm.llamacpp_server`` (the second with
``--no-jinja``). Each file: ``{"server", "request": {"method", "path", "body"}, "status", "response"}``."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import requests

from prorl_celery.llm.llamacpp_server import server_version

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "llamacpp"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def shot(question: str, command: str, output: str) -> list[dict]:
    call = {"id": "c", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}
    return [{"role": "user", "content": question}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": output}]


FEW_SHOT = ([{"role": "system", "content": "You are a shell agent. Reply with one <tool_call> only."}]
            + shot("List the files.", "ls", "a.txt") + shot("Show the current directory.", "pwd", "/work")
            + [{"role": "user", "content": "Print the date."}])


def record(name: str, base: str, method: str, path: str, body: dict | None = None) -> dict:
    resp = requests.request(method, base + path, json=body, timeout=120)
    data = resp.json()
    (OUT / f"{name}.json").write_text(json.dumps(
        {"server": server_version(), "request": {"method": method, "path": path, "body": body},
         "status": resp.status_code, "response": data}, indent=1) + "\n")
    return data


def main(jinja: str, no_jinja: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    record("models", jinja, "GET", "/v1/models")
    record("chat_tools", jinja, "POST", "/v1/chat/completions", {
        "messages": FEW_SHOT, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 40, "temperature": 1.0,
        "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "seed": 1, "logprobs": True})
    record("chat_tools_required", jinja, "POST", "/v1/chat/completions", {
        "messages": FEW_SHOT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 40, "temperature": 1.0,
        "seed": 1})
    record("chat_logprobs", jinja, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 12, "temperature": 1.0, "top_p": 1.0,
        "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "seed": 2, "logprobs": True, "top_logprobs": 1})
    text = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    ids = record("tokenize", jinja, "POST", "/tokenize", {"content": text, "add_special": False,
                                                           "parse_special": True, "with_pieces": False})["tokens"]
    record("tokenize_pieces", jinja, "POST", "/tokenize", {"content": "Hi <tool_call>", "with_pieces": True})
    record("detokenize", jinja, "POST", "/detokenize", {"tokens": ids})
    record("completion_ids", jinja, "POST", "/completion", {
        "prompt": ids, "n_predict": 16, "n_probs": 1, "post_sampling_probs": False, "return_tokens": True,
        "cache_prompt": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
        "seed": 3, "samplers": ["top_k", "top_p", "min_p", "temperature"], "stop": []})
    record("completion_ids_eos", jinja, "POST", "/completion", {
        "prompt": ids, "n_predict": 64, "n_probs": 1, "return_tokens": True, "temperature": 0.0, "seed": 3})
    record("completion_context_error", jinja, "POST", "/completion", {
        "prompt": list(range(100, 1200)), "n_predict": 4, "return_tokens": True})
    record("chat_context_error", jinja, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "word " * 1200}], "max_tokens": 4})
    record("chat_tools_without_jinja", no_jinja, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Print the date."}], "tools": TOOLS, "max_tokens": 4})
    record("v1_completions_echo", jinja, "POST", "/v1/completions", {
        "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1})
    record_forced_calls(jinja)


def record_forced_calls(jinja: str) -> None:
    """tool_choice required as the llama.cpp chat dialect sends it (its grammar, tool_choice none),
    and the refusal that makes it send none: a grammar beside tools that the server would parse."""
    from prorl_celery.llm.clients.chat import chat_body
    from prorl_celery.llm.models import LLMRequest, Protocol, SamplingParams
    from prorl_celery.llm.routing import Slot

    slot = Slot.direct(backend_id="r", address=jinja, protocol=Protocol.CHAT, dialect="llama.cpp")
    ask = [{"role": "system", "content": "You are a shell agent."}, {"role": "user", "content": "Print the date."}]
    body = chat_body(slot, LLMRequest(messages=ask, tools=TOOLS, sampling=SamplingParams(
        tool_choice="required", max_tokens=48, seed=1)), "smollm2")
    record("chat_tools_forced_by_grammar", jinja, "POST", "/v1/chat/completions", body)
    record("chat_grammar_beside_tools", jinja, "POST", "/v1/chat/completions", {
        **body, "tool_choice": "required"})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--forced-calls"]:
        record_forced_calls(sys.argv[2])
    else:
        main(*sys.argv[1:3])
