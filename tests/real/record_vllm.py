"""Record real vLLM answers once into tests/fixtures/recorded/vllm/ (the fake server's vLLM
dialects and the contract tests are built from them):
``python -m tests.real.record_vllm TOOLS_URL NO_TOOLS_URL``, both servers started as
tests/real/vllm_server.py does (the second without ``--enable-auto-tool-choice
--tool-call-parser hermes``). Each file: ``{"server", "request": {"method", "path", "body"},
"status", "response"}``. No ``seed`` in any body: vLLM-CPU kills its engine on a seeded request
whose prompt is prefilled in chunks (see prorl_celery/llm/dialects/vllm.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import requests

from tests.real.vllm_server import SERVED_NAME, server_version

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "vllm"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
ASK = [{"role": "system", "content": "You are a shell agent."}, {"role": "user", "content": "Print the date."}]
# every sampling field stated: vLLM would otherwise fill them from the model's generation config
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def record(name: str, base: str, method: str, path: str, body: dict | None = None) -> dict:
    resp = requests.request(method, base + path, json=body, timeout=300)
    data = resp.json()
    (OUT / f"{name}.json").write_text(json.dumps(
        {"server": server_version(base), "request": {"method": method, "path": path, "body": body},
         "status": resp.status_code, "response": data}, indent=1) + "\n")
    print(name, resp.status_code)
    return data


def main(tools: str, no_tools: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    record("models", tools, "GET", "/v1/models")
    record("chat_tools_required", tools, "POST", "/v1/chat/completions", {
        "model": SERVED_NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 160,
        **SAMPLING, "logprobs": True, "return_token_ids": True})
    record("chat_tools_auto", tools, "POST", "/v1/chat/completions", {
        "model": SERVED_NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 24,
        **SAMPLING, "logprobs": True, "return_token_ids": True})
    record("chat_return_token_ids", tools, "POST", "/v1/chat/completions", {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 12,
        **SAMPLING, "logprobs": True, "top_logprobs": 1, "return_token_ids": True})
    record("chat_tools_without_parser", no_tools, "POST", "/v1/chat/completions", {
        "model": SERVED_NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 8})
    record("chat_tools_required_without_parser", no_tools, "POST", "/v1/chat/completions", {
        "model": SERVED_NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 160,
        **SAMPLING})
    record("chat_context_error", tools, "POST", "/v1/chat/completions", {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": "word " * 2100}], "max_tokens": 4})
    ids = record("tokenize", tools, "POST", "/tokenize", {
        "model": SERVED_NAME, "messages": ASK, "tools": TOOLS, "add_generation_prompt": True})["tokens"]
    record("tokenize_text", tools, "POST", "/tokenize", {
        "model": SERVED_NAME, "prompt": "<|im_start|>user\nHi<tool_call><|im_end|>", "add_special_tokens": False,
        "return_token_strs": True})
    record("detokenize", tools, "POST", "/detokenize", {"model": SERVED_NAME, "tokens": ids[-8:]})
    record("completions_ids", tools, "POST", "/v1/completions", {
        "model": SERVED_NAME, "prompt": ids, "max_tokens": 16, "logprobs": 0, "return_token_ids": True,
        "return_tokens_as_token_ids": True, "echo": False, "n": 1, "stream": False,
        "skip_special_tokens": False, "stop_token_ids": [2], **SAMPLING})
    record("completions_prompt_logprobs", tools, "POST", "/v1/completions", {
        "model": SERVED_NAME, "prompt": ids[:12], "max_tokens": 1, "prompt_logprobs": 0, "logprobs": 0,
        "return_token_ids": True, "return_tokens_as_token_ids": True, **SAMPLING})
    record("completions_default_max_tokens", tools, "POST", "/v1/completions", {
        "model": SERVED_NAME, "prompt": ids, "return_token_ids": True, "ignore_eos": True, **SAMPLING})
    # a prompt that fits but leaves less room than max_tokens: vLLM clips, answers 200
    record("completions_clipped_to_context", tools, "POST", "/v1/completions", {
        "model": SERVED_NAME, "prompt": list(range(100, 2000)), "max_tokens": 200, "return_token_ids": True})
    record("completions_context_error", tools, "POST", "/v1/completions", {
        "model": SERVED_NAME, "prompt": list(range(100, 2150)), "max_tokens": 4, "return_token_ids": True})
    record("completions_max_tokens_too_large", tools, "POST", "/v1/completions", {
        "model": SERVED_NAME, "prompt": ids, "max_tokens": 4000, "return_token_ids": True})
    record("generate", tools, "POST", "/inference/v1/generate", {
        "token_ids": ids, "sampling_params": {"max_tokens": 16, "logprobs": 0, "stop_token_ids": [2],
                                              "skip_special_tokens": False, **SAMPLING}})
    record("generate_eos", tools, "POST", "/inference/v1/generate", {
        "token_ids": ids, "sampling_params": {"max_tokens": 64, "logprobs": 0, "temperature": 0.0}})
    record("generate_clipped_to_context", tools, "POST", "/inference/v1/generate", {
        "token_ids": list(range(100, 2000)), "sampling_params": {"max_tokens": 200}})
    record("generate_context_error", tools, "POST", "/inference/v1/generate", {
        "token_ids": list(range(100, 2150)), "sampling_params": {"max_tokens": 4}})
    record("generate_bad_params", tools, "POST", "/inference/v1/generate", {
        "token_ids": ids, "sampling_params": {"max_tokens": 4, "no_such_field": 1}})


if __name__ == "__main__":
    main(*sys.argv[1:3])
