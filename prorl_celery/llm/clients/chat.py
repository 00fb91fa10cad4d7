"""``chat`` protocol: OpenAI chat completions with tools and logprobs, in the backend's dialect:

- ``openai``: strict OpenAI fields only (no ``return_token_ids``, no top_k / min_p /
  repetition_penalty, which the OpenAI API rejects);
- ``vllm`` (the default): plus vLLM's sampling fields and ``return_token_ids`` (vLLM >= 0.10.2:
  the exact prompt and response ids);
- ``nemo-gym``: ``vllm`` plus the earlier turns' ids on their assistant messages (below);
- ``sglang``: vLLM's sampling names, no ``return_token_ids``;
- ``llama.cpp``: ``repeat_penalty``, top_k 0 = off, a fixed sampler chain, logprobs of the raw
  distribution (``post_sampling_probs`` false); each logprob entry carries its token ``id``, so
  the response ids are exact (the prompt ids are not reported). ``tool_choice`` ``required`` or a
  named function goes as a GBNF grammar for one Hermes call with ``tool_choice: none`` (llama.cpp
  lets the model talk before the call under ``required``; see :mod:`prorl_celery.llm.dialects.llamacpp_tools`), and the
  call is read from the text.

Token ids come from wherever the server puts them: vLLM's ``prompt_token_ids`` (top level) and
``choice.token_ids``, llama.cpp's logprob entries, or NeMo Gym's model server (and NeMo RL's vLLM),
which put ``prompt_token_ids``, ``generation_token_ids`` and ``generation_log_probs`` on the
message. The message's bundle comes whole (Gym's rule: all three or none) and wins; vLLM's fields,
when also there, must agree with it.

The ``nemo-gym`` dialect is ``vllm``'s body plus the previous turn's ids back on its assistant
message in the history (the same three fields): NeMo RL's vLLM behind Gym's model server then
builds the next prompt from them (its ``required_prefix_token_ids``) instead of re-rendering the
history, so every prompt extends the last one id for id. The ``vllm`` dialect sends only what vLLM
itself reads (a stock vLLM has no use for those keys: they were only weight on every request).

A logprob count other than the response's token count is a :class:`LogprobMismatch` (retried
on another backend), never padded.
"""
from __future__ import annotations

from typing import Any

from prorl_celery.errors import BackendFailed, LogprobMismatch
from prorl_celery.llm import chatml, tool_parsers
from prorl_celery.llm.clients.base import model_name, post, sampling_body
from prorl_celery.llm.dialects.llamacpp_tools import forced_call
from prorl_celery.llm.models import Dialect, LLMRequest, ToolCall, Turn
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.transport import Call

# The logprob definition a dialect's server uses unless the backend was registered with another.
DEFAULT_LOGPROBS_MODE = {Dialect.VLLM: "raw_logprobs", Dialect.NEMO_GYM: "raw_logprobs",
                         Dialect.LLAMACPP: "raw_logprobs"}
LLAMACPP_SAMPLERS = ["top_k", "top_p", "min_p", "temperature"]


def chat_body(slot: Slot, request: LLMRequest, model: str, max_tokens: int | None = None) -> dict[str, Any]:
    """The request body in the backend's dialect (also used by the registration probe)."""
    dialect = slot.backend.dialect or Dialect.VLLM
    names = {Dialect.OPENAI: "openai", Dialect.LLAMACPP: "llama.cpp", Dialect.SGLANG: "sglang-chat"}.get(dialect, "vllm")
    messages = request.messages
    if dialect is Dialect.NEMO_GYM:
        messages = with_token_history(messages, request.previous)
    body: dict[str, Any] = {"model": model, "messages": messages, "logprobs": True,
                            **sampling_body(request, names, max_tokens, chat=True)}
    if dialect in (Dialect.VLLM, Dialect.NEMO_GYM):
        body["return_token_ids"] = True
    elif dialect is Dialect.LLAMACPP:
        body["samplers"] = LLAMACPP_SAMPLERS
        body["post_sampling_probs"] = False
        body.update(forced_call(request.tools, body.get("tool_choice")))  # required: a grammar, not the flag
    if request.tools:
        body["tools"] = request.tools
    if request.chat_template_kwargs:
        body["chat_template_kwargs"] = request.chat_template_kwargs
    return body


GYM_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def with_token_history(messages: list[dict[str, Any]], previous: Turn | None) -> list[dict[str, Any]]:
    """``messages`` with the previous turn's exact ids on its own assistant message (a copy), when
    the turn has all three; the history is otherwise left as it is."""
    if previous is None or previous.prompt_ids is None or previous.response_ids is None:
        return messages
    if previous.logprobs is None or len(previous.logprobs) != len(previous.response_ids):
        return messages  # Gym's rule: the bundle comes whole or not at all
    at = previous.message_count
    if at >= len(messages) or messages[at].get("role") != "assistant":
        return messages
    out = list(messages)
    out[at] = {**messages[at], "prompt_token_ids": list(previous.prompt_ids),
               "generation_token_ids": list(previous.response_ids),
               "generation_log_probs": list(previous.logprobs)}
    return out


def _message_bundle(message: dict[str, Any]) -> tuple[list[int], list[int], list[float]] | None:
    """NeMo Gym's token fields on the message: all three, or None when there are none; a partial
    bundle is malformed (ValueError)."""
    present = [name for name in GYM_FIELDS if message.get(name) is not None]
    if not present:
        return None
    if len(present) != len(GYM_FIELDS):
        raise ValueError(f"token fields on the message are partial: {', '.join(present)} without the rest")
    prompt, generated, logprobs = (message[name] for name in GYM_FIELDS)
    if not all(isinstance(v, list) for v in (prompt, generated, logprobs)):
        raise ValueError("token fields on the message are not lists")
    if len(generated) != len(logprobs):
        raise ValueError(f"{len(generated)} generation_token_ids but {len(logprobs)} generation_log_probs")
    return [int(i) for i in prompt], [int(i) for i in generated], [float(x) for x in logprobs]


class ChatClient:
    def generate(self, slot: Slot, request: LLMRequest, call: Call) -> Turn:
        body = chat_body(slot, request, model_name(slot, request))
        data = post(slot, "/v1/chat/completions", body, call)
        try:
            return self._turn(slot, request, body["model"], data)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise BackendFailed(f"{slot.backend.address}: malformed chat completion: {exc!r}") from None

    @staticmethod
    def _turn(slot: Slot, request: LLMRequest, model: str, data: dict[str, Any]) -> Turn:
        backend = slot.backend
        choice = data["choices"][0]
        message = choice["message"]
        content = message.get("content")
        calls = [ToolCall(id=c.get("id") or f"call_{i}", name=c["function"]["name"],
                          arguments=c["function"].get("arguments") or "")
                 for i, c in enumerate(message.get("tool_calls") or [])]
        malformed = False
        parser = tool_parsers.get(backend.tool_parser)
        if request.tools and not calls and content and parser.marker(content):
            content, calls, malformed = parser.split(content, request.tools)  # server had no tool parser
        entries = (choice.get("logprobs") or {}).get("content") or []
        response_ids = choice.get("token_ids") or data.get("response_token_ids")
        if response_ids is None and entries and all("id" in e for e in entries):
            response_ids = [int(e["id"]) for e in entries]  # llama.cpp: each entry names its token
        prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
        logprobs = [float(e["logprob"]) for e in entries] or None
        bundle = _message_bundle(message)
        if bundle is not None:  # NeMo Gym's model server / NeMo RL's vLLM
            for mine, theirs, name in ((prompt_ids, bundle[0], "prompt"), (response_ids, bundle[1], "response")):
                if mine is not None and list(mine) != theirs:
                    raise ValueError(f"the message's {name} token ids disagree with the response's")
            prompt_ids, response_ids, logprobs = bundle[0], bundle[1], bundle[2] or None
        _check_counts(slot, logprobs, response_ids, (data.get("usage") or {}).get("completion_tokens"))
        finish = choice.get("finish_reason")
        return Turn(backend_id=backend.id, address=backend.address, weight_version=backend.weight_version,
                    protocol=backend.protocol, model=model, content=content, tool_calls=calls,
                    finish_reason=finish, prompt_ids=prompt_ids, response_ids=response_ids,
                    logprobs=logprobs, logprobs_mode=backend.logprobs_mode or DEFAULT_LOGPROBS_MODE.get(
                        backend.dialect or Dialect.VLLM) if logprobs else None,
                    token_source="server" if response_ids is not None else "none",
                    message_count=len(request.messages),
                    format_error="tool_call" if malformed else ("length" if finish == "length" else None))


def _check_counts(slot: Slot, logprobs: list[float] | None, ids: list[int] | None, completion: Any) -> None:
    """One logprob per generated token, or none at all."""
    if logprobs is None:
        return
    tokens = len(ids) if ids is not None else (int(completion) if isinstance(completion, int) else None)
    if tokens is not None and tokens != len(logprobs):
        raise LogprobMismatch(f"{slot.backend.address}: {len(logprobs)} logprobs for {tokens} generated tokens")
