"""``ScriptedPolicy``: the agent loop's ``Policy`` in process, answering from a script through the
fake LLM server's own code, without HTTP.

Each call runs what the ``generate`` client and the fake server would do over the wire: the
prompt is built by :func:`prorl_celery.llm.clients.generate.build_prompt` (the previous turn's prompt and
response ids, the template's turn closing, the new messages' ids), clipped to the context window
by :func:`~prorl_celery.llm.clients.generate.max_new_tokens` (ContextWindowExceeded when no room is left),
answered by the fake server's ``fake`` dialect (the reply's text and Hermes ``<tool_call>``
blocks encoded, its end-of-turn id appended, cut at ``max_tokens`` with finish ``length``, its
deterministic logprobs), and read back into a :class:`Turn` as the client does (tool calls
parsed, ``format_error`` set). So ids, loss masks and logprobs are those an end-to-end run with
``prorl-celery fake-llm --policy scripted:FILE`` records.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Union

from prorl_celery.errors import LLMCallCancelled
from prorl_celery.llm.clients.base import model_name
from prorl_celery.fakes.llm.engine import BatchEngine, LatencyModel
from prorl_celery.fakes.llm.policies import Reply
from prorl_celery.fakes.llm.state import FakeLLM
from prorl_celery.fakes.llm.token_api import fake_generate
from prorl_celery.llm.clients.generate import GenerateClient, build_prompt, max_new_tokens, wire_for
from prorl_celery.llm.models import LLMRequest, Protocol, Turn
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.tokenizer import get_tokenizer

Step = Union[str, dict, Reply, BaseException]
"""A script entry: the fake server's script format (a string, or ``{"content", "tool_calls":
[{"name", "arguments"}]}``), or an exception the call raises instead (an LLM error)."""

_engine: BatchEngine | None = None
_engine_lock = threading.Lock()


def _instant_engine() -> BatchEngine:
    """One engine per process: with ``step_s`` 0 it finishes every sequence at once."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = BatchEngine(LatencyModel())
        return _engine


def _step(entry: Step) -> Reply | BaseException:
    if isinstance(entry, (Reply, BaseException)):
        return entry
    return Reply(content=entry) if isinstance(entry, str) else Reply.model_validate(entry)


class ScriptExhausted(AssertionError):
    """The loop asked for more turns than the script has."""


class ScriptedPolicy:
    """Call *k* answers entry *k* of ``script``; ``requests`` keeps what the loop asked, and
    ``fake.records`` what the fake server saw (prompt and response ids)."""

    def __init__(self, script: Sequence[Step], *, max_model_len: int = 32768, tokenizer: str = "byte",
                 model: str = "prorl-fake-byte", weight_version: str | None = None):
        self.steps = [_step(entry) for entry in script]
        self.tok = get_tokenizer(tokenizer)
        self.fake = FakeLLM(self, _instant_engine(), model, max_model_len, self.tok)
        self.slot = Slot.direct(backend_id="scripted", address="inprocess://scripted", protocol=Protocol.GENERATE,
                                model=model, weight_version=weight_version, max_model_len=max_model_len,
                                tokenizer=tokenizer, dialect="fake")
        self.requests: list[LLMRequest] = []
        self._reply = Reply()

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> "ScriptedPolicy":
        """The file ``prorl-celery fake-llm --policy scripted:FILE`` reads (a list, or ``{"turns"}``)."""
        data = json.loads(Path(path).read_text())
        return cls(data["turns"] if isinstance(data, dict) else data, **kwargs)

    def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Reply:
        """What the fake server asks its policy (``fake_policies.Policy``): this call's entry."""
        return self._reply

    def generate(self, request: LLMRequest, should_stop: Callable[[], bool]) -> Turn:
        if should_stop():  # as the pool checks before each attempt
            raise LLMCallCancelled("LLM call cancelled")
        if len(self.requests) >= len(self.steps):
            raise ScriptExhausted(f"the script has {len(self.steps)} turns; turn {len(self.requests) + 1} "
                                  "was asked for")
        step = self.steps[len(self.requests)]
        self.requests.append(request)
        if isinstance(step, BaseException):
            raise step
        self._reply = step
        model = model_name(self.slot, request)
        prompt = build_prompt(self.tok, request)
        max_tokens = max_new_tokens(self.slot, request, prompt)
        wire = wire_for(self.slot)
        data = fake_generate(self.fake, wire.body(request, model, self.tok, prompt, max_tokens), None)
        return GenerateClient._turn(self.slot, request, model, self.tok, prompt, wire.answer(data), max_tokens,
                                    wire.logprobs_mode)
