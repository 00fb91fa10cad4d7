"""``nemo-gym``: NeMo Gym's model server. vLLM's chat body, plus the previous turn's exact ids back
on its own assistant message in the history (the three fields of
:data:`~prorl_celery.llm.dialects.chat_wire.GYM_FIELDS`): NeMo RL's vLLM behind Gym's model server
then builds the next prompt from them (its ``required_prefix_token_ids``) instead of re-rendering
the history, so every prompt extends the last one id for id. The ``vllm`` dialect sends only what
vLLM itself reads (a stock vLLM has no use for those keys: they were only weight on every request).
The answer carries the same bundle on its message (read by the chat wire, whatever the dialect)."""
from __future__ import annotations

from typing import Any

from prorl_celery.llm.dialects.base import Dialect
from prorl_celery.llm.dialects.vllm import VllmChat
from prorl_celery.llm.models import LLMRequest, Turn


class NemoGymChat(VllmChat):
    def messages(self, request: LLMRequest) -> list[dict[str, Any]]:
        return with_token_history(request.messages, request.previous)


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


class NemoGym(Dialect):
    name = "nemo-gym"
    server = "nemo-gym"
    chat = NemoGymChat()
    probe_hints = {"tools": "a vLLM behind Gym's model server started with --enable-auto-tool-choice "
                            "--tool-call-parser",
                   "exact_tokens": "return_token_id_information: true in the Gym model server's config"}
