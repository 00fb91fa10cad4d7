"""One rollout session's gateway state: the calls it made (to continue their ids), its budget,
its cancellation, and the recorder every completed call is appended to once."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pydantic import BaseModel, Field

from prorl_celery.errors import BudgetSpent, LLMCallCancelled
from prorl_celery.gateway.models import CallRecord, GatewayRequest
from prorl_celery.gateway.prefix import Seen, canonical, common_prefix, find_base, tools_key
from prorl_celery.gateway.store import CallStore
from prorl_celery.llm.models import LLMRequest, Protocol, Turn

Generate = Callable[[LLMRequest, Callable[[], bool]], Turn]


class Budget(BaseModel):
    """What a harness may spend through its gateway; 0 or None: no limit."""

    max_calls: int | None = Field(None, ge=1, description="LLM calls.")
    max_tokens: int | None = Field(None, ge=1, description="Generated tokens over all calls.")
    wall_s: float | None = Field(None, gt=0, description="Seconds from the session's start.")


class GatewaySession:
    """Turns a caller's :class:`GatewayRequest` into a generated :class:`Turn` and a record.

    ``generate`` is the LLM pool's (token mode); ``stop`` aborts the in-flight calls (the job was
    cancelled); ``tokenizer``/``max_model_len`` pass through to the pool's request; ``sampling``
    (SamplingParams fields) overrides what each call asks for."""

    def __init__(self, session_id: str, generate: Generate, store: CallStore, budget: Budget | None = None,
                 stop: Callable[[], bool] | None = None, tokenizer: str | None = None,
                 max_model_len: int | None = None, sampling: dict | None = None):
        self.session_id = session_id
        self.generate = generate
        self.store = store
        self.budget = budget or Budget()
        self.stop_flag = threading.Event()
        self._external_stop = stop
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.sampling = dict(sampling or {})  # over every call's own (the trainer's say)
        self.started = time.monotonic()
        self.history: list[Seen] = []
        self.generated_tokens = 0
        self.in_flight = 0
        self.finish_reason: str | None = None
        self.lock = threading.Lock()

    def stopped(self) -> bool:
        return self.stop_flag.is_set() or bool(self._external_stop and self._external_stop())

    def cancel(self) -> None:
        """Abort the in-flight calls and refuse new ones."""
        self.stop_flag.set()

    def complete(self, request: GatewayRequest, api: str) -> Turn:
        """Generate the next assistant turn of ``request``'s conversation and record it."""
        t0 = time.monotonic()
        if self.stopped():
            raise LLMCallCancelled(f"gateway session {self.session_id} is closed")
        self._admit()
        with self.lock:
            base = find_base(self.history, request.messages, request.tools)
            self.in_flight += 1
        previous = None
        if base is not None:
            previous = base.turn.model_copy(update={"message_count": len(base.messages)})
        sampling = request.sampling.model_copy(update=self.sampling) if self.sampling else request.sampling
        llm = LLMRequest(messages=request.messages, tools=request.tools, sampling=sampling,
                         protocol=Protocol.GENERATE, previous=previous, tokenizer=self.tokenizer,
                         max_model_len=self.max_model_len, timeout_s=self._timeout())
        try:
            t1 = time.monotonic()
            turn = self.generate(llm, self.stopped)
            generated_s = time.monotonic() - t1
        finally:
            with self.lock:
                self.in_flight -= 1
        self._record(request, api, base, turn, time.monotonic() - t0 - generated_s)
        return turn

    def _timeout(self) -> float | None:
        if not self.budget.wall_s:
            return None
        return max(0.1, self.budget.wall_s - (time.monotonic() - self.started))

    def _admit(self) -> None:
        b = self.budget
        with self.lock:
            if b.max_calls and len(self.history) >= b.max_calls:
                reason = "max_calls"
            elif b.max_tokens and self.generated_tokens >= b.max_tokens:
                reason = "max_tokens"
            elif b.wall_s and time.monotonic() - self.started >= b.wall_s:
                reason = "wall_time"
            else:
                return
            self.finish_reason = self.finish_reason or reason
        raise BudgetSpent(reason)

    def _record(self, request: GatewayRequest, api: str, base: Seen | None, turn: Turn, own_s: float) -> None:
        prompt = list(turn.prompt_ids or [])
        with self.lock:
            index = len(self.history)
            if base is None and self.history:  # a fresh render: share what it happens to share
                last = self.history[-1]
                shared = common_prefix(last.context, prompt)
                ref = last if shared else None
            else:
                ref, shared = base, len(base.context) if base else 0
            self.history.append(Seen(index, [canonical(m) for m in request.messages], tools_key(request.tools),
                                     turn))
            self.generated_tokens += len(turn.response_ids or [])
            record = CallRecord(
                index=index, api=api, base=ref.index if ref else None, shared=shared, prompt_tail=prompt[shared:],
                continued=base is not None, response_ids=list(turn.response_ids or []), logprobs=turn.logprobs,
                finish_reason=turn.finish_reason, weight_version=turn.weight_version, backend_id=turn.backend_id,
                model=turn.model, message_count=len(request.messages), tool_calls=len(turn.tool_calls),
                format_error=turn.format_error, started_at=turn.started_at, latency_s=turn.latency_s,
                gateway_s=round(own_s, 6))
            self.store.append(self.session_id, record)

    def count_tokens(self, request: GatewayRequest) -> int:
        """The prompt's length in the tokenizer of the session's model (the last call's; before
        any call, the session's ``tokenizer``, else the byte tokenizer): rendered, not generated."""
        from prorl_celery.llm.tokenizer import get_tokenizer

        name = self.tokenizer or (self.history[-1].turn.model if self.history else None)
        tok = get_tokenizer(name)
        return len(tok.apply_chat_template(request.messages, tools=request.tools, add_generation_prompt=True))

    def records(self) -> list[CallRecord]:
        return self.store.records(self.session_id)
