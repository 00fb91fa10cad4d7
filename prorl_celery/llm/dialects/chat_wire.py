"""The chat wire every chat dialect builds on: OpenAI chat completions with tools and logprobs.
A dialect overrides the sampling names, its own body fields and the messages it sends; the answer
is read the same way for all of them.

Token ids are read from wherever the server puts them, whatever the dialect: vLLM's
``prompt_token_ids`` (top level) and ``choice.token_ids``, llama.cpp's logprob entries (each names
its token ``id``), or the bundle NeMo Gym's model server (and NeMo RL's vLLM) put on the message:
``prompt_token_ids``, ``generation_token_ids`` and ``generation_log_probs``. The message's bundle
comes whole (Gym's rule: all three or none) and wins; vLLM's fields, when also there, must agree
with it. A server that returns a tool call as raw text has it read by the backend's tool parser.
"""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from prorl_celery.llm import tool_parsers
from prorl_celery.llm.dialects import served
from prorl_celery.llm.dialects.sampling import Sampling
from prorl_celery.llm.models import LLMRequest, ToolCall

GYM_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class ChatAnswer(NamedTuple):
    """A chat completion as the chat client reads it."""

    content: str | None
    tool_calls: list[ToolCall]
    malformed: bool  # a tool call in the text that could not be parsed
    prompt_ids: list[int] | None
    response_ids: list[int] | None
    logprobs: list[float] | None
    finish_reason: str | None
    served: served.Served = served.NOTHING  # the routing trace and prefix-cache hit the server reported


class ChatWire:
    """OpenAI chat completions in one server's dialect."""

    path: ClassVar[str] = "/v1/chat/completions"
    sampling: ClassVar[Sampling] = Sampling()
    logprobs_mode: ClassVar[str | None] = None  # the logprob definition its server reports by default

    def messages(self, request: LLMRequest) -> list[dict[str, Any]]:
        """The conversation as this server is sent it."""
        return request.messages

    def extra(self, body: dict[str, Any], request: LLMRequest) -> None:
        """The dialect's own fields, added to ``body`` (before the tools)."""

    def body(self, request: LLMRequest, model: str, max_tokens: int | None = None) -> dict[str, Any]:
        """The request body (also used by the registration probe)."""
        body: dict[str, Any] = {"model": model, "messages": self.messages(request), "logprobs": True,
                                **self.sampling.body(request, max_tokens, chat=True)}
        self.extra(body, request)
        if request.tools:
            body["tools"] = request.tools
        if request.chat_template_kwargs:
            body["chat_template_kwargs"] = request.chat_template_kwargs
        return body

    def answer(self, data: dict[str, Any], request: LLMRequest, tool_parser: str | None) -> ChatAnswer:
        """The completion read: content and tool calls, token ids and logprobs where the server
        gives them. Raises KeyError, IndexError, TypeError or ValueError on a malformed answer."""
        choice = data["choices"][0]
        message = choice["message"]
        content, calls, malformed = read_calls(message, request, tool_parser)
        prompt_ids, response_ids, logprobs = read_tokens(data, choice, message)
        return ChatAnswer(content, calls, malformed, prompt_ids, response_ids, logprobs, choice.get("finish_reason"),
                          served.openai(data, choice))


def read_calls(message: dict[str, Any], request: LLMRequest,
               tool_parser: str | None) -> tuple[str | None, list[ToolCall], bool]:
    """The message's content and tool calls: the server's own, else (the server had no tool
    parser) those written in the text, in the backend's format."""
    content = message.get("content")
    calls = [ToolCall(id=c.get("id") or f"call_{i}", name=c["function"]["name"],
                      arguments=c["function"].get("arguments") or "")
             for i, c in enumerate(message.get("tool_calls") or [])]
    parser = tool_parsers.get(tool_parser)
    if request.tools and not calls and content and parser.marker(content):
        return parser.split(content, request.tools)
    return content, calls, False


def read_tokens(data: dict[str, Any], choice: dict[str, Any], message: dict[str, Any]
                ) -> tuple[list[int] | None, list[int] | None, list[float] | None]:
    """(prompt ids, response ids, logprobs) from wherever the server put them (module docstring)."""
    entries = (choice.get("logprobs") or {}).get("content") or []
    response_ids = choice.get("token_ids") or data.get("response_token_ids")
    if response_ids is None and entries and all("id" in e for e in entries):
        response_ids = [int(e["id"]) for e in entries]  # llama.cpp: each entry names its token
    prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
    logprobs = [float(e["logprob"]) for e in entries] or None
    bundle = message_bundle(message)
    if bundle is None:
        return prompt_ids, response_ids, logprobs
    _agree(prompt_ids, bundle[0], "prompt")
    _agree(response_ids, bundle[1], "response")
    return bundle[0], bundle[1], bundle[2] or None


def _agree(mine: list[int] | None, theirs: list[int], name: str) -> None:
    """The server's own ids, where it also gave them, are the message bundle's."""
    if mine is not None and list(mine) != theirs:
        raise ValueError(f"the message's {name} token ids disagree with the response's")


def message_bundle(message: dict[str, Any]) -> tuple[list[int], list[int], list[float]] | None:
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
