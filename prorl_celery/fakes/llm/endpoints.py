"""The fake LLM server's chat endpoint, ``/v1/models`` and ``/tokenize`` (see
:mod:`prorl_celery.fakes.llm.server`; token endpoints in :mod:`prorl_celery.fakes.llm.token_api`,
what they share in :mod:`prorl_celery.fakes.llm.wire`).

Chat (and the other shared OpenAI paths) answers in the shape of the server named by ``--flavor`` (``vllm``, ``llama.cpp`` or
``sglang``), as recorded from the real ones (``tests/fixtures/recorded``): vLLM's extra fields
(``token_ids``, ``prompt_token_ids`` with ``return_token_ids``, ``stop_reason``, ``reasoning_content``),
llama.cpp's logprob entries with ids and its ``timings``.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import TYPE_CHECKING, Any

from prorl_celery.llm import chatml

from prorl_celery.fakes.llm import llamacpp as fake_llamacpp
from prorl_celery.fakes.llm.wire import (FINGERPRINT, check_max_tokens, llamacpp_error, llamacpp_max_tokens,
                                         llamacpp_probs, timings, usage, vllm_error, vllm_max_tokens, vllm_usage)

if TYPE_CHECKING:
    from prorl_celery.fakes.llm.state import FakeLLM

TOOL_PARSER_MISSING = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
REQUIRED_PARSER_MISSING = 'tool_choice="required" requires --tool-call-parser to be set'


GRAMMAR_WITH_TOOLS = "Cannot use custom grammar constraints with tools."
_GRAMMAR_CALL_RE = re.compile(r'<tool_call>\\n\{\\"name\\": \\"(.*?)\\"')


def forced_tool(body: dict[str, Any], flavor: str = "vllm") -> str | None:
    """The tool a request forces: vLLM (its grammar for ``tool_choice``): a named function, ``"*"``
    for ``required``. llama.cpp: a request ``grammar`` that admits nothing but a Hermes call (the
    one name it allows, or ``"*"``); ``required`` gives ``"*"`` too (its grammar admits a call at once,
    though the real model may talk first: measured); a named function is ignored, as there."""
    if flavor == "llama.cpp":
        names = _GRAMMAR_CALL_RE.findall(body.get("grammar") or "") if isinstance(body.get("grammar"), str) else []
        if names:
            return names[0] if len(set(names)) == 1 else "*"
        return "*" if body.get("tool_choice") == "required" else None
    choice = body.get("tool_choice")
    if choice == "required":
        return "*"
    if isinstance(choice, dict):
        return (choice.get("function") or {}).get("name") or "*"
    return None


def _check_tools(fake: FakeLLM, body: dict[str, Any]) -> None:
    """vLLM started without ``--enable-auto-tool-choice --tool-call-parser`` refuses tools under
    ``tool_choice`` auto (the default when tools are sent)."""
    if body.get("tools") and not fake.options.tool_parser:
        if body.get("tool_choice") in (None, "auto"):
            raise vllm_error(400, TOOL_PARSER_MISSING)
        if body.get("tool_choice") == "required":
            raise vllm_error(400, REQUIRED_PARSER_MISSING)


def chat_completion(fake: FakeLLM, body: dict[str, Any], sock) -> dict[str, Any] | None:
    messages, tools = body.get("messages"), body.get("tools")
    flavor = fake.options.flavor
    if not isinstance(messages, list) or not messages:
        raise vllm_error(400, "messages: a non-empty list is required", param="messages")
    if flavor == "vllm":
        _check_tools(fake, body)
    if flavor == "llama.cpp" and tools and not fake.options.tool_parser:  # started without --jinja
        raise llamacpp_error(500, "tools param requires --jinja flag", "server_error")
    if flavor == "llama.cpp" and tools and body.get("tool_choice") != "none" and "grammar" in body:
        raise llamacpp_error(400, GRAMMAR_WITH_TOOLS)
    prompt = fake.tok.apply_chat_template(messages, tools=tools)
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    if flavor == "llama.cpp":
        max_tokens = llamacpp_max_tokens(fake, prompt, asked)
    else:
        check_max_tokens(asked, fake.max_model_len)
        max_tokens = vllm_max_tokens(fake, prompt, asked, None)
    entry = fake.generate(messages, tools, prompt, max_tokens, "chat", sock, ignore_eos=bool(body.get("ignore_eos")),
                          min_tokens=int(body.get("min_tokens") or 0), force_tool=forced_tool(body, flavor),
                          seeded=body.get("seed") is not None)
    if entry is None:
        return None
    return (llamacpp_chat if flavor == "llama.cpp" else vllm_chat)(fake, body, prompt, entry)


def _message(fake: FakeLLM, ids: list[int], finish: str) -> tuple[dict[str, Any], str]:
    text = fake.tok.decode([i for i in ids if i not in fake.tok.stop_ids])
    content, calls, _ = chatml.split_tool_calls(text)
    finish = "tool_calls" if calls and finish == "stop" else finish
    message = {"role": "assistant", "content": content or (None if calls else ""),
               "tool_calls": [c.to_openai() for c in calls]}
    return message, finish


def vllm_chat(fake: FakeLLM, body: dict[str, Any], prompt: list[int], entry: dict[str, Any]) -> dict[str, Any]:
    ids = entry["response_ids"]
    message, finish = _message(fake, ids, entry["finish_reason"])
    calls = message.pop("tool_calls")
    for call in calls:
        call["id"] = f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"
    message["content"] = message["content"] or ""
    message.update(refusal=None, annotations=None, audio=None, function_call=None)
    if calls:  # vLLM names tool_calls only when there are some
        message["tool_calls"] = calls
    message["reasoning"] = None
    logprobs = None
    if body.get("logprobs"):
        logprobs = {"content": vllm_logprob_entries(fake, ids, int(body.get("top_logprobs") or 0),
                                                    bool(body.get("return_tokens_as_token_ids")))}
    stop_reason = None
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish,
                              "stop_reason": stop_reason, "token_ids": ids if body.get("return_token_ids") else None,
                              "routed_experts": entry.get("routed_experts")}
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or fake.model, "choices": [choice], "service_tier": None,
            "system_fingerprint": FINGERPRINT, "usage": vllm_usage(prompt, ids, fake, entry), "prompt_logprobs": None,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def vllm_logprob_entries(fake: FakeLLM, ids: list[int], top: int, as_ids: bool = False) -> list[dict[str, Any]]:
    """vLLM's chat-style entries: ``top`` alternatives (the sampled token stands in for them);
    ``as_ids`` (``return_tokens_as_token_ids``): each token named ``token_id:<id>``."""
    out = []
    for t, lp in zip(ids, fake.logprobs(ids)):
        text = fake.tok.decode([t])
        entry = {"token": f"token_id:{t}" if as_ids else text, "logprob": lp, "bytes": list(text.encode())}
        out.append({**entry, "top_logprobs": [dict(entry) for _ in range(top)]})
    return out


def llamacpp_chat(fake: FakeLLM, body: dict[str, Any], prompt: list[int], entry: dict[str, Any]) -> dict[str, Any]:
    ids = entry["response_ids"]
    message, finish = _message(fake, ids, entry["finish_reason"])
    if body.get("tool_choice") == "none":  # no tool parsing: a call the model wrote stays in the text
        message = {"role": "assistant", "content": fake.tok.decode([i for i in ids if i not in fake.tok.stop_ids])}
        finish = entry["finish_reason"]
    if message.get("tool_calls"):  # llama.cpp's key order; an id of its own; no key when there is no call
        message["content"] = message["content"] or ""
        message["tool_calls"] = [{"type": "function", "function": c["function"], "id": uuid.uuid4().hex}
                                 for c in message["tool_calls"]]
    else:
        message.pop("tool_calls", None)
    choice: dict[str, Any] = {"finish_reason": finish, "index": 0, "message": message}
    if body.get("logprobs"):
        choice["logprobs"] = {"content": llamacpp_probs(fake, ids, body.get("top_logprobs") or 1)}
    return {"choices": [choice], "created": int(time.time()), "model": body.get("model") or fake.model,
            "system_fingerprint": "b0-prorl-fake", "object": "chat.completion",
            "usage": {**usage(prompt, ids), "prompt_tokens_details": {"cached_tokens": entry.get("cached_tokens", 0)}},
            "id": f"chatcmpl-{uuid.uuid4().hex}", "timings": timings(prompt, ids)}


def models(fake: FakeLLM) -> dict[str, Any]:
    """``GET /v1/models``: vLLM's card has ``max_model_len``, llama.cpp's ``meta.n_ctx``."""
    if fake.options.flavor == "llama.cpp":
        return fake_llamacpp.models(fake)
    return {"object": "list", "data": [{"id": fake.model, "object": "model", "created": int(time.time()),
                                        "owned_by": "prorl-fake", "root": fake.model, "parent": None,
                                        "max_model_len": fake.max_model_len, "permission": []}]}


def tokenize(fake: FakeLLM, body: dict[str, Any], sock) -> dict[str, Any]:
    """llama.cpp's ``{"content"}`` -> ``{"tokens"}`` (ids, or ``{"id", "piece"}`` with ``with_pieces``);
    vLLM's ``{"prompt"}`` or ``{"messages"}`` -> ``{"count", "max_model_len", "tokens"}``."""
    if "content" in body:
        ids = fake.tok.encode(str(body["content"]))
        if body.get("with_pieces"):
            return {"tokens": [{"id": t, "piece": fake.tok.decode([t])} for t in ids]}
        return {"tokens": ids}
    if isinstance(body.get("messages"), list):
        ids = fake.tok.apply_chat_template(body["messages"], tools=body.get("tools"))
    else:
        ids = fake.tok.encode(str(body.get("prompt") or ""))
    strs = [fake.tok.decode([t]) for t in ids] if body.get("return_token_strs") else None
    return {"count": len(ids), "max_model_len": fake.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(fake: FakeLLM, body: dict[str, Any], sock) -> dict[str, Any]:
    """llama.cpp's ``{"tokens"}`` -> ``{"content"}``; vLLM's -> ``{"prompt"}``."""
    text = fake.tok.decode([int(t) for t in body.get("tokens") or []])
    return {"content": text} if fake.options.flavor == "llama.cpp" else {"prompt": text}
