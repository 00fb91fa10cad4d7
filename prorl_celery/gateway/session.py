"""One rollout session's gateway state: the calls it made (to continue their ids), its budget,
its cancellation, and the log (:class:`~prorl_celery.rollout.calllog.CallLog`) every completed
call is added to once, for the rollout store."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from prorl_celery.errors import BudgetSpent, LLMCallCancelled
from prorl_celery.gateway.models import GatewayRequest
from prorl_celery.gateway.prefix import Seen, find_base
from prorl_celery.rollout.calllog import RESENT, CallLog
from prorl_celery.rollout.store import Call
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
    (SamplingParams fields) overrides what each call asks for; ``after_answer`` runs on the call's
    thread once its caller has the answer (``LLMPool.send_releases`` for a pool that defers them)."""

    def __init__(self, session_id: str, generate: Generate, log: CallLog, budget: Budget | None = None,
                 stop: Callable[[], bool] | None = None, tokenizer: str | None = None,
                 max_model_len: int | None = None, sampling: dict | None = None,
                 after_answer: Callable[[], Any] | None = None, fence: Any = None):
        self.session_id = session_id
        self.generate = generate
        self.log = log
        self.budget = budget or Budget()
        self.stop_flag = threading.Event()
        self._external_stop = stop
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.sampling = dict(sampling or {})  # over every call's own (the trainer's say)
        self._after_answer = after_answer
        # the staleness bound (tasks.agent.fence.StalenessFence, as the built-in agent's): its
        # counts in fence_data["staleness"], one entry of turn_versions per recorded call
        # under fence_lock only, which is never held while taking another lock: the run stage
        # reads the counts while it saves, under the call log's lock, which _record takes
        # under self.lock
        self.fence = fence
        self.fence_data: dict[str, Any] = {}
        self.fence_lock = threading.Lock()
        self.started = time.monotonic()
        self.history: list[Seen] = []
        self.generated_tokens = 0
        self.llm_s = 0.0  # the pool's time over the calls (generate), and the gateway's own
        self.gateway_s = 0.0
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
        if self.fence is not None:  # the session goes on: earlier calls beyond the bound are masked
            with self.fence_lock:
                self.fence.fence(self.fence_data)
        with self.lock:
            base, canon, key = find_base(self.history, request.messages, request.tools)
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
            fresh = None
            if self.fence is not None:
                turn, fresh = self._fresh(turn, llm)
            generated_s = time.monotonic() - t1
        finally:
            with self.lock:
                self.in_flight -= 1
        self._record(request, api, base, Seen(0, canon, key, turn), time.monotonic() - t0 - generated_s, fresh)
        return turn

    def _fresh(self, turn: Turn, llm: LLMRequest) -> tuple[Turn, dict[str, Any]]:
        """The fence's ``regenerate``: the call's answer has not reached the harness yet, so a stale
        one is generated again on the current weights (its tokens counted, thrown away), as the
        built-in agent's latest turn is; ``mask``: the turn as it is. Its counts, to be added to
        the session's in the order the call is recorded."""
        scratch: dict[str, Any] = {}
        turn = self.fence.fresh(turn, lambda: self.generate(llm, self.stopped), scratch)
        return turn, scratch["staleness"]

    def fence_all(self) -> dict[str, Any] | None:
        """The session ended: mask every call beyond the bound now; the counts (None: no bound)."""
        if self.fence is None:
            return None
        with self.fence_lock:
            self.fence.fence(self.fence_data)
        return self.staleness()

    def staleness(self) -> dict[str, Any] | None:
        """The fence's counts so far, the built-in agent's ``staleness`` block (None: no bound)."""
        if self.fence is None:
            return None
        with self.fence_lock:
            stats = self.fence.stats(self.fence_data)
            return {**stats, "masked_turns": list(stats["masked_turns"]),
                    "turn_versions": [list(v) for v in stats["turn_versions"]]}

    def answered(self) -> None:
        """The caller has its answer: wake whoever saves the call, and run ``after_answer`` (the
        pool's deferred lease releases), off the call's path."""
        self.log.wake()
        if self._after_answer is not None:
            self._after_answer()

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

    def _record(self, request: GatewayRequest, api: str, base: Seen | None, seen: Seen, own_s: float,
                fresh: dict[str, Any] | None = None) -> None:
        turn = seen.turn
        with self.lock:
            if fresh is not None:  # the fence's counts of this call, its versions at its index
                with self.fence_lock:
                    stats = self.fence.stats(self.fence_data)
                    stats["regenerated_turns"] += fresh["regenerated_turns"]
                    stats["regenerated_tokens"] += fresh["regenerated_tokens"]
                    stats["turn_versions"].extend(fresh["turn_versions"])
            seen.index = index = len(self.history)
            last = self.history[-1] if self.history else None
            self.history.append(seen)
            self.generated_tokens += len(turn.response_ids or [])
            self.llm_s += turn.latency_s
            self.gateway_s += own_s
            # the conversation the rollout gains: past the last call's answer when this call
            # continues it, else the whole of what was sent (assistant messages in it marked as
            # sent again: no call of this log made them); then this call's own answer
            if base is not None and base is last:
                sent = request.messages[len(base.messages) + 1:]
            else:
                sent = [{**m, RESENT: True} if m.get("role") == "assistant" else m for m in request.messages]
            meta = {"api": api, "continued": base is not None, "gateway_s": round(own_s, 6)}
            self.log.add(turn, [*sent, turn.message], meta)

    def count_tokens(self, request: GatewayRequest) -> int:
        """The prompt's length in the tokenizer of the session's model (the last call's; before
        any call, the session's ``tokenizer``, else the byte tokenizer): rendered, not generated."""
        from prorl_celery.llm.tokenizer import get_tokenizer

        name = self.tokenizer or (self.history[-1].turn.model if self.history else None)
        tok = get_tokenizer(name)
        return len(tok.apply_chat_template(request.messages, tools=request.tools, add_generation_prompt=True))

    def calls(self) -> list[Call]:
        """The session's recorded calls, in order (from the log: saved or not yet)."""
        return self.log.calls()
