"""The sampling engine behind :class:`prorl_celery.integrations.serve.LiveModelServer`: requests that
arrive together are decoded together, and a weight update can freeze them between two decode steps.

**Batching.** A request waits in a queue; the engine's thread takes the first one, keeps taking
what arrives within ``window_s`` (up to ``max_batch``), and decodes those rows in one loop: left
padding, one key/value cache, one forward per generated token for the whole batch. Each row
keeps its own ``max_tokens``, stop ids, ``min_tokens``, temperature and seed (its own random
generator when seeded), and leaves the batch's answer as soon as it is done. A group's n
rollouts reach the server at the same moment, so they are sampled as one batch, not n times.
Rows whose filters differ (``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``) are still
decoded together: the filters are applied row by row.

**Logprobs** are those of the model's raw distribution (vLLM's default ``raw_logprobs``): the
log-softmax of the unprocessed logits at the sampled id, before temperature or any filter.

**Pause** (vLLM's semantics, see :mod:`prorl_celery.fakes.llm.pause_api`): ``keep`` parks the loop
between two decode steps — :meth:`pause` returns once no forward is running, so the caller may
write the weights — and after :meth:`resume` the same rows go on, on the new weights; ``abort``
ends the rows in flight with their tokens so far (``finish_reason`` ``abort``); ``wait`` returns
once they finished. In every mode requests that arrive while paused wait. Each generated token
is stamped with the version name current when it was sampled (:meth:`name_version`), which the
answer reports as vLLM's ``weight_versions`` spans.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

PauseMode = Literal["keep", "abort", "wait"]


@dataclass
class RowParams:
    """One request's sampling set, in vLLM's meaning (``top_k`` 0 or -1: off)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    min_tokens: int = 0


@dataclass
class Row:
    prompt: list[int]
    params: RowParams
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    generator: Any = None

    def spans(self) -> list[dict[str, Any]]:
        """vLLM's ``weight_versions``: ``[{"version", "start", "end"}]`` over the generated ids."""
        out: list[dict[str, Any]] = []
        for i, version in enumerate(self.versions):
            if out and out[-1]["version"] == version:
                out[-1]["end"] = i + 1
            else:
                out.append({"version": version, "start": i, "end": i + 1})
        return out


class LiveEngine:
    """Batched sampling from ``model`` (the trainer's own object) with a pause between decode steps.

    ``lock`` is held for every forward pass: a caller that holds it (or has paused the engine)
    may change the weights. The engine never changes the model's train/eval flag (another thread
    is training it); models with dropout should not be served this way while training.
    """

    def __init__(self, model: Any, pad_id: int, version: str = "default", window_s: float = 0.05,
                 max_batch: int = 64):
        self.model, self.pad_id, self.version = model, pad_id, version
        self.window_s, self.max_batch = window_s, max_batch
        self.lock = threading.Lock()
        self.batches: list[dict[str, Any]] = []  # per batch: rows, prompt length, seconds (for benchmarks)
        self._queue: queue.Queue[Row] = queue.Queue()
        self._state = threading.Condition()
        self._paused: PauseMode | None = None
        self._running: list[Row] = []
        self._stop = False
        self._shared: Any = None  # the random stream of unseeded rows
        self._forward_version = version
        self._thread = threading.Thread(target=self._loop, name="live-engine", daemon=True)

    def start(self) -> "LiveEngine":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._state:
            self._stop, self._paused = True, None
            self._state.notify_all()
        self._queue.put(None)  # type: ignore[arg-type]  # wakes the loop

    # -- the caller's side ----------------------------------------------------------------------
    def submit(self, prompt: list[int], params: RowParams, timeout: float | None = None) -> Row:
        """Sample for one request (blocks until its row is done)."""
        row = Row(prompt=list(prompt), params=params)
        self._queue.put(row)
        if not row.done.wait(timeout):
            raise TimeoutError("the engine did not answer in time")
        if row.error is not None:
            raise row.error
        return row

    def pause(self, mode: PauseMode) -> None:
        """Returns once it is safe to write the weights (``keep``/``abort``: no forward running;
        ``wait``: the rows in flight finished)."""
        with self._state:
            self._paused = mode
            self._state.notify_all()
        if mode == "wait":
            with self._state:
                self._state.wait_for(lambda: not self._running or self._stop)
        with self.lock:  # a forward that started before the flag was set has ended
            pass

    def resume(self) -> None:
        with self._state:
            self._paused = None
            self._state.notify_all()

    def name_version(self, version: str) -> None:
        """The name of the weights from now on (tokens sampled after it carry it)."""
        with self._state:
            self.version = version

    @property
    def paused(self) -> bool:
        return self._paused is not None

    # -- the engine's thread --------------------------------------------------------------------
    def _take_batch(self) -> list[Row]:
        first = self._queue.get()
        if first is None:
            return []
        rows = [first]
        deadline = time.monotonic() + self.window_s
        while len(rows) < self.max_batch:
            left = deadline - time.monotonic()
            try:
                row = self._queue.get(timeout=max(left, 0.0)) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if row is None:
                break
            rows.append(row)
        return rows

    def _loop(self) -> None:
        while not self._stop:
            rows = self._take_batch()
            if not rows:
                continue
            with self._state:  # a new batch starts only while not paused (any mode)
                self._state.wait_for(lambda: self._paused is None or self._stop)
                if self._stop:
                    break
                self._running = rows
            try:
                self._decode(rows)
            except BaseException as exc:  # noqa: BLE001 - each request gets the error, the loop goes on
                for row in rows:
                    if not row.done.is_set():
                        row.error = exc
            finally:
                with self._state:
                    self._running = []
                    self._state.notify_all()
                for row in rows:
                    row.done.set()

    def _forward(self, **kwargs: Any) -> Any:
        """One forward pass under the lock, parked while paused in keep mode; None when an abort
        pause ends the batch (a wait pause lets it run to its end)."""
        while True:
            with self._state:
                self._state.wait_for(lambda: self._paused != "keep" or self._stop)
                if self._stop:
                    return None
            with self.lock:
                with self._state:
                    mode = self._paused
                if mode == "abort":
                    return None
                if mode == "keep":
                    continue  # paused between our check and the lock: park again
                self._forward_version = self.version  # the weights these logits come from
                return self.model(**kwargs)

    def _decode(self, rows: list[Row]) -> None:
        import torch

        started = time.monotonic()
        device = next(self.model.parameters()).device
        width = max(len(r.prompt) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row.prompt):] = torch.tensor(row.prompt)
            mask[i, width - len(row.prompt):] = 1
            row.generator = self._generator(row)
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        steps = max(r.params.max_tokens for r in rows)
        with torch.no_grad():
            from transformers import DynamicCache

            cache = {self._cache_arg(): DynamicCache()}
            out = self._forward(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                logits_to_keep=1, **cache)
            for step in range(steps):
                if out is None:  # aborted by a pause
                    break
                logits = out.logits[:, -1, :].float()
                version = self._forward_version
                nxt = torch.full((len(rows),), self.pad_id, dtype=torch.long)
                for i, row in enumerate(rows):
                    if row.finish_reason is not None:
                        continue
                    token, logprob = self._sample(row, logits[i])
                    row.ids.append(token)
                    row.logprobs.append(logprob)
                    row.versions.append(version)
                    nxt[i] = token
                    if token in row.params.stop_ids:  # masked out before min_tokens
                        row.finish_reason = "stop"
                    elif len(row.ids) >= row.params.max_tokens:
                        row.finish_reason = "length"
                    if row.finish_reason is not None:
                        row.done.set()
                if all(r.finish_reason is not None for r in rows) or step == steps - 1:
                    break
                mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=-1)
                positions = positions[:, -1:] + 1
                out = self._forward(input_ids=nxt.view(-1, 1).to(device), attention_mask=mask, position_ids=positions,
                                    use_cache=True, **cache)
        for row in rows:
            if row.finish_reason is None:
                row.finish_reason = "abort" if out is None else "length"
        if len(self.batches) >= 10_000:  # a long-lived server keeps the recent ones
            del self.batches[:5_000]
        self.batches.append({"rows": len(rows), "prompt_len": width, "tokens": sum(len(r.ids) for r in rows),
                             "seconds": time.monotonic() - started, "ended": time.monotonic()})

    def _cache_arg(self) -> str:
        """The forward's name for the key/value cache: ``cache`` (transformers >= 5.2x), else
        ``past_key_values``."""
        import inspect

        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def _generator(self, row: Row) -> Any:
        """The row's random stream: its own when seeded, else the engine's (the trainer's global
        stream is never drawn from)."""
        import torch

        if row.params.seed is not None:
            return torch.Generator().manual_seed(int(row.params.seed))
        if self._shared is None:
            self._shared = torch.Generator().manual_seed(int(torch.initial_seed()) % (2**63))
        return self._shared

    def _sample(self, row: Row, logits: Any) -> tuple[int, float]:
        """One id for ``row`` from its raw ``logits`` (1-D), and that id's raw logprob."""
        import torch

        p = row.params
        raw = torch.log_softmax(logits, dim=-1)
        work = logits.clone()
        if len(row.ids) < p.min_tokens and p.stop_ids:
            work[list(p.stop_ids)] = float("-inf")
        if p.repetition_penalty != 1.0:  # transformers' rule, over the prompt and what was generated
            seen = torch.tensor(sorted(set(row.prompt) | set(row.ids)), dtype=torch.long)
            vals = work[seen]
            work[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.temperature <= 0:
            token = int(torch.argmax(work))
            return token, float(raw[token])
        work = work / p.temperature
        if p.top_k and p.top_k > 0 and p.top_k < work.numel():
            kth = torch.topk(work, p.top_k).values[-1]
            work[work < kth] = float("-inf")
        probs = torch.softmax(work, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = sorted_probs.cumsum(-1)
            drop = cumulative - sorted_probs > p.top_p  # keep the smallest head reaching top_p
            probs[order[drop]] = 0.0
        if p.min_p > 0:
            probs[probs < p.min_p * probs.max()] = 0.0
        token = int(torch.multinomial(probs, 1, generator=row.generator))
        return token, float(raw[token])
