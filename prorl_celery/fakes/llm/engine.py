"""The fake server's latency model of a batching GPU server (test and demo tool).

Up to ``capacity`` sequences decode together; each step emits one token for every running
sequence and takes ``step_s * (1 + slowdown * (n - 1) / capacity) / speed`` for ``n`` running
sequences, so time per token grows with concurrency while total throughput still rises up to the
capacity. Sequences beyond the capacity wait in a queue. One engine thread advances all
sequences and also watches their client sockets, so a client that disconnects aborts its
sequence (as vLLM does) and is counted.

Prefill (``prefill_s`` > 0): an admitted sequence first needs ``prefill_s / speed`` seconds per
prompt token that its server's prefix cache does not hold; prefill runs before decoding, one
sequence at a time, and the batch's decoding waits meanwhile (a scheduler that puts prefill
first). The prefix cache (``cache_tokens``) keeps prompt + response blocks of 16 tokens, least
recently used evicted, as vLLM's automatic prefix caching and llama.cpp's slot cache do; the last
prompt token is always computed. Measured on the real servers here (bench/RESULTS.md): a
cached prefix costs next to nothing, an uncached token about ``prefill_s``.

Pause (the real servers' semantics, see :mod:`prorl_celery.fakes.llm.pause_api`): ``pause("keep")``
freezes every sequence where it stands (no step runs, nothing is admitted) until ``resume()``;
``pause("wait")`` admits nothing new and returns once the running ones finished; ``pause("abort")``
ends every sequence at once, each with the tokens it had (``cut``). Each sequence records which
weight version produced which of its tokens (``spans``): ``set_version`` starts a new span for
every live sequence at the token it has reached.
"""
from __future__ import annotations

import math
import os
import select
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field


class LatencyModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step_s: float = Field(0.0, ge=0, description="Seconds per decode step with one running sequence (0: instant).")
    capacity: int = Field(64, ge=1, description="Sequences decoded at once; more wait in a queue.")
    slowdown: float = Field(1.0, ge=0, description="Extra step time at full batch, as a fraction of step_s.")
    speed: float = Field(1.0, gt=0, description="Speed factor: 0.5 is a backend half as fast.")
    prefill_s: float = Field(0.0, ge=0, description="Seconds per uncached prompt token (0: prefill is free).")
    cache_tokens: int = Field(0, ge=0, description="Prefix cache size in tokens (0: nothing is cached).")

    @classmethod
    def parse(cls, spec: str | None, **overrides: float) -> "LatencyModel":
        """``"step_s=0.02,capacity=16,slowdown=1"`` (``batch:`` prefix allowed, ``none``: instant)."""
        values: dict[str, float] = {}
        text = (spec or "none").removeprefix("batch:").strip()
        if text and text not in ("none", "batch"):
            for item in text.split(","):
                name, _, value = item.partition("=")
                values[name.strip()] = float(value)
        values.update({k: v for k, v in overrides.items() if v is not None})
        for name in ("capacity", "cache_tokens"):
            if name in values:
                values[name] = int(values[name])
        return cls(**values)

    def step_time(self, running: int) -> float:
        return self.step_s * (1 + self.slowdown * (max(running, 1) - 1) / self.capacity) / self.speed


class PrefixCache:
    """Token blocks by the hash of the whole prefix up to them; LRU beyond ``capacity`` tokens."""

    BLOCK = 16

    def __init__(self, capacity: int):
        self.capacity_blocks = capacity // self.BLOCK
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def _hashes(self, ids: list[int]) -> list[int]:
        out, h = [], 0
        for k in range(len(ids) // self.BLOCK):
            h = hash((h, tuple(ids[k * self.BLOCK:(k + 1) * self.BLOCK])))
            out.append(h)
        return out

    def cached(self, ids: list[int]) -> int:
        """Leading tokens of ``ids`` held (whole blocks), refreshed as used."""
        n = 0
        for h in self._hashes(ids):
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n * self.BLOCK

    def add(self, ids: list[int]) -> None:
        for h in self._hashes(ids):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)


@dataclass(eq=False)
class _Seq:
    tokens_left: float
    sock: socket.socket | None
    done: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False
    prefill_left: float = 0.0
    total: float = 0.0
    cut: int | None = None  # ended by a pause in abort mode after this many tokens
    spans: list[tuple[str, int]] = field(default_factory=list)  # (weight version, first token index)

    def produced(self) -> int:
        return max(0, min(int(self.total), int(self.total - self.tokens_left + 1e-6)))

    def version_spans(self, n: int) -> list[dict[str, object]]:
        """vLLM's ``weight_versions``: ``[{"version", "start", "end"}]`` over the first ``n`` tokens."""
        out = []
        for k, (version, start) in enumerate(self.spans):
            end = self.spans[k + 1][1] if k + 1 < len(self.spans) else n
            start, end = min(start, n), min(end, n)
            if end > start:
                out.append({"version": version, "start": start, "end": end})
        return out


class BatchEngine:
    def __init__(self, model: LatencyModel):
        self.model = model
        self.lock = threading.Lock()
        self.running: list[_Seq] = []
        self.waiting: deque[_Seq] = deque()
        self.poller = select.poll()
        self.watched: dict[int, _Seq] = {}
        self.cache = PrefixCache(model.cache_tokens) if model.cache_tokens else None
        self._wake_r, self._wake_w = os.pipe()
        self.poller.register(self._wake_r, select.POLLIN)
        self.version = "default"
        self.paused: str | None = None  # keep | wait | abort while paused
        self.resumed = threading.Condition(self.lock)
        self.reset_stats()
        threading.Thread(target=self._loop, name="fake-llm-engine", daemon=True).start()

    def reset_stats(self) -> None:
        with getattr(self, "lock", threading.Lock()):
            self.t_start = self.t_last = time.monotonic()
            self.busy_s = self.slot_s = self.tokens = 0.0
            self.completed = self.aborted = self.peak = 0
            self.prompt_tokens = self.prefilled_tokens = 0

    def stats(self) -> dict[str, float]:
        with self.lock:
            self._advance(time.monotonic())
            elapsed = max(self.t_last - self.t_start, 1e-9)
            return {"elapsed_s": elapsed, "running": len(self.running), "waiting": len(self.waiting),
                    "busy_fraction": self.busy_s / elapsed, "occupancy": self.slot_s / elapsed,
                    "tokens": self.tokens, "completed": self.completed, "aborted": self.aborted,
                    "peak_running": self.peak, "capacity": self.model.capacity, "speed": self.model.speed,
                    "prompt_tokens": self.prompt_tokens, "prefilled_tokens": self.prefilled_tokens}

    def load(self) -> dict[str, int]:
        """SGLang's ``/get_load`` entry: requests running and waiting, tokens still to decode."""
        with self.lock:
            self._advance(time.monotonic())
            left = sum(max(int(s.tokens_left), 0) for s in [*self.running, *self.waiting])
            return {"dp_rank": 0, "num_reqs": len(self.running) + len(self.waiting),
                    "num_waiting_reqs": len(self.waiting), "num_tokens": left}

    def run(self, tokens: int, sock: socket.socket | None, prompt: list[int] | None = None,
            response: list[int] | None = None) -> bool:
        """Block while ``prompt`` is prefilled (its uncached part) and ``tokens`` tokens are
        generated; False if the client went away first. A completed ``prompt + response`` is cached."""
        return not self.run_seq(tokens, sock, prompt, response).aborted

    def run_seq(self, tokens: int, sock: socket.socket | None, prompt: list[int] | None = None,
                response: list[int] | None = None) -> _Seq:
        """:meth:`run`, returning the sequence: ``aborted`` (the client went away), ``cut`` (a
        pause in abort mode ended it), ``spans`` (the weight versions of its tokens)."""
        if self.model.step_s <= 0:  # instant: only a pause holds it (admission waits for resume)
            with self.lock:
                while self.paused is not None:
                    self.resumed.wait(0.5)
                self.completed += 1
                return _Seq(0.0, sock, total=float(tokens), spans=[(self.version, 0)])
        seq = _Seq(float(max(tokens, 1)), sock, total=float(max(tokens, 1)))
        with self.lock:
            seq.spans.append((self.version, 0))
            if prompt and self.model.prefill_s > 0:
                cached = min(self.cache.cached(prompt), len(prompt) - 1) if self.cache else 0
                self.prompt_tokens += len(prompt)
                self.prefilled_tokens += len(prompt) - cached
                seq.prefill_left = (len(prompt) - cached) * self.model.prefill_s / self.model.speed
            self.waiting.append(seq)
            if sock is not None:
                self.watched[sock.fileno()] = seq
                self.poller.register(sock.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        os.write(self._wake_w, b"x")
        seq.done.wait()
        if self.cache is not None and prompt and not seq.aborted and seq.cut is None:
            with self.lock:
                self.cache.add(list(prompt) + list(response or []))
        return seq

    # -- pause ----------------------------------------------------------------------------
    def pause(self, mode: str, wait_s: float = 600.0) -> dict[str, int]:
        """Pause in ``mode`` (keep | wait | abort); returns once it is in effect: ``{"frozen",
        "aborted", "waited"}`` sequence counts."""
        out = {"frozen": 0, "aborted": 0, "waited": 0}
        with self.lock:
            self._advance(time.monotonic())
            self.paused = mode
            if mode == "abort":
                for seq in [*self.running, *self.waiting]:
                    seq.cut = seq.produced()
                    self._finish(seq, aborted=False)
                    out["aborted"] += 1
            elif mode == "keep":
                out["frozen"] = len(self.running) + len(self.waiting)
        self._wake()
        if mode == "wait":
            deadline = time.monotonic() + wait_s
            with self.lock:
                out["waited"] = len(self.running)
                while self.running and time.monotonic() < deadline:
                    self.resumed.wait(0.05)
        return out

    def resume(self) -> None:
        with self.lock:
            self._advance(time.monotonic())
            self.paused = None
            self.resumed.notify_all()
        self._wake()

    def set_version(self, version: str) -> None:
        """Tokens produced from now on (by every live sequence too) come from ``version``."""
        with self.lock:
            self._advance(time.monotonic())
            for seq in [*self.running, *self.waiting]:
                if seq.spans and seq.spans[-1][0] != version:
                    seq.spans.append((version, seq.produced()))
            self.version = version

    def _wake(self) -> None:
        os.write(self._wake_w, b"x")

    # -- engine thread --------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        dt, n = now - self.t_last, len(self.running)
        self.t_last = now
        if n == 0 or dt <= 0 or self.paused in ("keep", "abort"):  # frozen in place: time passes, no step
            return
        self.busy_s += dt
        self.slot_s += dt * n / self.model.capacity
        for seq in self.running:  # prefill first, in admission order; decoding waits meanwhile
            if dt <= 0:
                return
            if seq.prefill_left > 0:
                used = min(dt, seq.prefill_left)
                seq.prefill_left -= used
                dt -= used
        decoding = [seq for seq in self.running if seq.prefill_left <= 1e-9]
        if dt <= 0 or not decoding:
            return
        progress = dt / self.model.step_time(len(decoding))
        self.tokens += progress * len(decoding)
        for seq in decoding:
            seq.tokens_left -= progress

    def _finish(self, seq: _Seq, aborted: bool) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.sock is not None and self.watched.pop(seq.sock.fileno(), None) is not None:
            self.poller.unregister(seq.sock.fileno())
        seq.aborted = aborted
        if aborted:
            self.aborted += 1
        else:
            self.completed += 1
        seq.done.set()

    def _step(self) -> float | None:
        """Advance, retire finished sequences, admit waiting ones; seconds until the next finish."""
        with self.lock:
            self._advance(time.monotonic())
            for seq in [s for s in self.running if s.tokens_left <= 1e-6]:
                self._finish(seq, aborted=False)
            if self.paused is not None:
                self.resumed.notify_all()  # a pause in wait mode watches the running ones end
                if self.paused != "wait" or not self.running:
                    return None
                return min(s.tokens_left for s in self.running) * self.model.step_time(len(self.running))
            while self.waiting and len(self.running) < self.model.capacity:
                self.running.append(self.waiting.popleft())
            self.peak = max(self.peak, len(self.running))
            if not self.running:
                return None
            prefilling = [s.prefill_left for s in self.running if s.prefill_left > 1e-9]
            if prefilling:
                return prefilling[0]
            return min(s.tokens_left for s in self.running) * self.model.step_time(len(self.running))

    def _loop(self) -> None:
        while True:
            timeout = self._step()
            events = self.poller.poll(None if timeout is None else math.ceil(timeout * 1000))
            for fd, _ in events:
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                self._check_disconnect(fd)

    def _check_disconnect(self, fd: int) -> None:
        with self.lock:
            self._advance(time.monotonic())
            seq = self.watched.get(fd)
            if seq is None or seq.sock is None:
                return
            try:
                data = seq.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if data:  # the client sent more (pipelining): stop watching, it is not a disconnect
                self.watched.pop(fd)
                self.poller.unregister(fd)
                return
            self._finish(seq, aborted=True)
