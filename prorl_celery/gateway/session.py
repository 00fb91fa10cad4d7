"""One rollout session's gateway state: the calls it made (to continue their ids), its budget
(reserved per call before it is spent: :mod:`prorl_celery.gateway.budget`), the trainer's sampling
authority (:mod:`prorl_celery.gateway.sampling`), its cancellation, and the log
(:class:`~prorl_celery.rollout.calllog.CallLog`) every completed call is added to once, for the
rollout store, within the store's byte quotas and with each message's provenance."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from prorl_celery.errors import BudgetSpent, LLMCallCancelled
from prorl_celery.gateway.budget import Budget, Grant, Ledger, Limits
from prorl_celery.gateway.models import GatewayRequest
from prorl_celery.gateway.prefix import Seen, find_base, rendered_turns, tools_key
from prorl_celery.gateway.sampling import SamplingAuthority
from prorl_celery.rollout.calllog import CallLog
from prorl_celery.rollout.store import Call, RolloutQuota
from prorl_celery.llm.models import LLMRequest, Protocol, SamplingParams, Turn

Generate = Callable[[LLMRequest, Callable[[], bool]], Turn]
__all__ = ["Budget", "BudgetSpent", "GatewaySession", "Limits"]


class GatewaySession:
    """Turns a caller's :class:`GatewayRequest` into a generated :class:`Turn` and a record.

    ``generate`` is the LLM pool's (token mode); ``stop`` aborts the in-flight calls (the job was
    cancelled); ``tokenizer``/``max_model_len`` pass through to the pool's request; ``sampling``
    (SamplingParams fields: the trainer's) is what every call is sampled with, whatever the
    harness asks (:class:`SamplingAuthority`); ``after_answer`` runs on the call's thread once its
    caller has the answer (``LLMPool.send_releases`` for a pool that defers them); ``limits`` and
    ``quota``: the operator's caps on operations and bytes (default: the settings')."""

    def __init__(self, session_id: str, generate: Generate, log: CallLog, budget: Budget | None = None,
                 stop: Callable[[], bool] | None = None, tokenizer: str | None = None,
                 max_model_len: int | None = None, sampling: dict | None = None,
                 after_answer: Callable[[], Any] | None = None, fence: Any = None,
                 limits: Limits | None = None, quota: RolloutQuota | None = None):
        self.session_id = session_id
        self.generate = generate
        self.log = log
        self.budget = budget or Budget()
        self.stop_flag = threading.Event()
        self._external_stop = stop
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.authority = SamplingAuthority(sampling)
        self.dropped: dict[str, int] = {}  # harness-sent sampling field -> calls it was dropped from
        self.quota = quota or RolloutQuota.from_settings()
        stored = log.transcript.size if log is not None else 0  # what the rollout holds already
        self.ledger = Ledger(self.budget, limits or Limits.from_settings(), self.quota, stored)
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
        self.llm_s = 0.0  # the pool's time over the calls (generate), and the gateway's own
        self.gateway_s = 0.0
        self.lock = threading.Lock()

    @property
    def finish_reason(self) -> str | None:
        """The first budget that refused a call (None: none did)."""
        return self.ledger.finish_reason

    @property
    def in_flight(self) -> int:
        return self.ledger.in_flight

    @property
    def generated_tokens(self) -> int:
        return self.ledger.tokens

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
        self.ledger.enter()  # rate and concurrency before any work
        try:
            sampling, dropped = self.authority.effective(request.sampling)
            base, canon, key, sent, encoded, retokenized = self._admitted(request)
            grant = self.ledger.reserve(sampling.max_tokens, sum(map(len, encoded)))
        except BaseException:
            self.ledger.leave()
            raise
        try:
            if self.fence is not None:  # the session goes on: earlier calls beyond the bound are masked
                with self.fence_lock:
                    self.fence.fence(self.fence_data)
            llm = self._request(request, base, sampling, grant)
            t1 = time.monotonic()
            turn = self.generate(llm, self.stopped)
            fresh = None
            if self.fence is not None:
                turn, fresh = self._fresh(turn, llm)
            generated_s = time.monotonic() - t1
        except BaseException:
            self.ledger.settle(grant)
            raise
        call = _Call(base, Seen(0, canon, key, turn), sent, encoded, llm.sampling, dropped, grant, retokenized)
        self._record(call, api, time.monotonic() - t0 - generated_s, fresh)
        return turn

    def _request(self, request: GatewayRequest, base: Seen | None, sampling: SamplingParams,
                 grant: Grant) -> LLMRequest:
        """The pool's request: the trainer's sampling, its max_tokens clipped to the tokens the
        call reserved; its ids continued from ``base``'s."""
        if grant.tokens is not None and grant.tokens != sampling.max_tokens:
            sampling = sampling.model_copy(update={"max_tokens": grant.tokens})  # never past the budget's room
        previous = None
        if base is not None:
            previous = base.turn.model_copy(update={"message_count": len(base.messages)})
        return LLMRequest(messages=request.messages, tools=request.tools, sampling=sampling,
                          protocol=Protocol.GENERATE, previous=previous, tokenizer=self.tokenizer,
                          max_model_len=self.max_model_len, timeout_s=self.ledger.remaining_s())

    def _admitted(self, request: GatewayRequest) -> tuple[Seen | None, list[tuple], str, list, list[bytes], int]:
        """The earlier call ``request`` continues (None: none), its canonical messages and tools
        key, and what the rollout gains by it: past the last call's answer when it continues
        that call, else the whole of what was sent; encoded, and held to the store's quotas,
        before anything is generated (its tools too: they are rendered and kept for the next
        call's search). Last, the earlier generated turns its prompt renders from text, their
        ids not reused (:func:`~prorl_celery.gateway.prefix.rendered_turns`; 0 before any call)."""
        with self.lock:
            base, canon, key = find_base(self.history, request.messages, request.tools)
            continues_last = base is not None and base is (self.history[-1] if self.history else None)
            retokenized = rendered_turns(request.messages, base) if self.history else 0
        if len(key) > self.quota.call_bytes:
            raise self.quota.exceeded("rollout_call_max_bytes", len(key), "the tools", "tools")
        first = len(base.messages) + 1 if continues_last else 0
        sent = request.messages[first:]
        return base, canon, key, sent, self.quota.encode(sent, first), retokenized

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

    def _record(self, call: _Call, api: str, own_s: float, fresh: dict[str, Any] | None = None) -> None:
        turn = call.seen.turn
        meta: dict[str, Any] = {"api": api, "continued": call.base is not None,
                                "retokenized": call.retokenized, "gateway_s": round(own_s, 6),
                                "sampling": (self.authority.base_dump if call.sampling is self.authority.base
                                             else self.authority.dump(call.sampling))}
        if call.dropped:
            meta["dropped"] = call.dropped
        stored = 0
        try:
            with self.lock:
                if fresh is not None:  # the fence's counts of this call, its versions at its index
                    with self.fence_lock:
                        stats = self.fence.stats(self.fence_data)
                        stats["regenerated_turns"] += fresh["regenerated_turns"]
                        stats["regenerated_tokens"] += fresh["regenerated_tokens"]
                        stats["turn_versions"].extend(fresh["turn_versions"])
                call.seen.index = len(self.history)
                self.history.append(call.seen)
                self.llm_s += turn.latency_s
                self.gateway_s += own_s
                for name in call.dropped:
                    self.dropped[name] = self.dropped.get(name, 0) + 1
                resent = [m.get("role") == "assistant" for m in call.sent]
                stored = self.log.add(turn, list(zip(call.encoded, resent)), meta)
        finally:
            self.ledger.settle(call.grant, len(turn.response_ids or []), stored)

    def sampling_report(self) -> dict[str, Any]:
        """What the result says of sampling: the trainer's set every call was sampled with, and
        the harness-sent fields dropped (name -> calls)."""
        with self.lock:
            return {"set": self.authority.base_dump, "dropped": dict(self.dropped)}

    def models(self) -> None:
        """Admit a ``models`` request as an operation (rate, concurrency, count)."""
        self.ledger.enter()
        self.ledger.leave()

    def count_tokens(self, request: GatewayRequest) -> int:
        """The prompt's length in the tokenizer of the session's model (the last call's; before
        any call, the session's ``tokenizer``, else the byte tokenizer): rendered, not generated.
        An operation like a call (rate, concurrency, count), its messages and tools held to the
        store's message and call quotas (what it renders is bounded as what a call stores)."""
        from prorl_celery.llm.tokenizer import get_tokenizer

        self.ledger.enter()
        try:
            size = sum(map(len, self.quota.encode(request.messages))) + len(tools_key(request.tools))
            if size > self.quota.call_bytes:
                raise self.quota.exceeded("rollout_call_max_bytes", size, "the messages and tools", "messages")
            name = self.tokenizer or (self.history[-1].turn.model if self.history else None)
            tok = get_tokenizer(name)
            return len(tok.apply_chat_template(request.messages, tools=request.tools, add_generation_prompt=True))
        finally:
            self.ledger.leave()

    def calls(self) -> list[Call]:
        """The session's recorded calls, in order (from the log: saved or not yet)."""
        return self.log.calls()


class _Call:
    """A call between its admission and its record."""

    __slots__ = ("base", "seen", "sent", "encoded", "sampling", "dropped", "grant", "retokenized")

    def __init__(self, base: Seen | None, seen: Seen, sent: list[dict[str, Any]], encoded: list[bytes],
                 sampling: SamplingParams, dropped: list[str], grant: Grant, retokenized: int = 0):
        self.base, self.seen, self.sent, self.encoded = base, seen, sent, encoded
        self.sampling, self.dropped, self.grant, self.retokenized = sampling, dropped, grant, retokenized
