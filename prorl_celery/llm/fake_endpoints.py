"""The fake LLM server's generation endpoints: OpenAI chat completions, token-in/token-out
``/generate``, and SGLang's native ``/generate`` (see :mod:`prorl_celery.llm.fake_server`)."""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from prorl_celery.llm import chatml

if TYPE_CHECKING:
    from prorl_celery.llm.fake_server import FakeLLM

SGLANG_MAX_NEW_TOKENS = 128  # SGLang's default when a request names none


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.type = status, type_


def chat_completion(fake: FakeLLM, body: dict[str, Any], sock) -> dict[str, Any] | None:
    messages, tools = body.get("messages"), body.get("tools")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages: a non-empty list is required")
    prompt = fake.tok.apply_chat_template(messages, tools=tools)
    entry = fake.generate(messages, tools, prompt, body, "chat", sock)
    if entry is None:
        return None
    ids = entry["response_ids"]
    text = fake.tok.decode([i for i in ids if i not in fake.tok.stop_ids])
    content, calls, _ = chatml.split_tool_calls(text)
    finish = "tool_calls" if calls and entry["finish_reason"] == "stop" else entry["finish_reason"]
    message = {"role": "assistant", "content": content or (None if calls else ""),
               "tool_calls": [c.to_openai() for c in calls]}
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    if body.get("logprobs"):
        choice["logprobs"] = {"content": [{"token": fake.tok.decode([t]), "logprob": lp, "top_logprobs": []}
                                          for t, lp in zip(ids, fake.logprobs(ids))]}
    out = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
           "model": body.get("model") or fake.model, "choices": [choice],
           "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                     "total_tokens": len(prompt) + len(ids)}}
    if body.get("return_token_ids"):
        choice["token_ids"] = ids
        out["prompt_token_ids"] = prompt
    return out


def _token_ids(body: dict[str, Any], name: str) -> list[int]:
    ids = body.get(name)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise HTTPError(400, f"{name}: a non-empty list of token ids is required")
    return ids


def generate(fake: FakeLLM, body: dict[str, Any], sock) -> dict[str, Any] | None:
    if "input_ids" in body:
        return sglang_generate(fake, body, sock)
    prompt = _token_ids(body, "prompt_ids")
    messages = chatml.parse(fake.tok.decode(prompt))
    entry = fake.generate(messages, None, prompt, body, "generate", sock)
    if entry is None:
        return None
    ids = entry["response_ids"]
    return {"response_ids": ids, "logprobs": fake.logprobs(ids), "finish_reason": entry["finish_reason"],
            "text": fake.tok.decode(ids)}


def sglang_generate(fake: FakeLLM, body: dict[str, Any], sock) -> dict[str, Any] | None:
    """SGLang's native ``/generate`` for one prompt of ``input_ids`` (no streaming, no batches)."""
    prompt = _token_ids(body, "input_ids")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise HTTPError(400, "sampling_params: an object is required")
    room = fake.max_model_len - len(prompt)  # SGLang clips its default to the room left, not a given value
    params = {"max_tokens": sampling.get("max_new_tokens") or min(SGLANG_MAX_NEW_TOKENS, max(room, 0)) or None,
              "min_tokens": sampling.get("min_new_tokens"), "ignore_eos": sampling.get("ignore_eos")}
    messages = chatml.parse(fake.tok.decode(prompt))
    entry = fake.generate(messages, None, prompt, params, "sglang", sock, sampling_params=sampling)
    if entry is None:
        return None
    ids = entry["response_ids"]
    matched = entry["finish_reason"] == "stop" and bool(ids) and ids[-1] in fake.tok.stop_ids
    finish = {"type": "stop", "matched": ids[-1]} if matched else {"type": "length", "length": len(ids)}
    meta: dict[str, Any] = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(prompt),
                            "completion_tokens": len(ids), "cached_tokens": 0}
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, fake.logprobs(ids))]
    text = fake.tok.decode(ids[:-1] if matched else ids)  # SGLang trims the matched stop token from the text
    return {"text": text, "output_ids": ids, "meta_info": meta}
