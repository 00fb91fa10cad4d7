"""The sampling engine behind :class:`prorl_celery.integrations.serve.LiveModelServer`: rows are
decoded together, rows join and leave between decode steps, and a weight update can freeze them
between two steps.

**Continuous batching.** A request waits in a queue. With nothing running, the engine's thread
takes the first one and what arrives within ``window_s`` (a group's n rollouts reach the server
together, so they are prefilled as one batch, not n times). While rows run, whatever has queued
is admitted before each decode step (up to ``max_batch`` rows in all): it is prefilled on its own
and joined to the running batch (:mod:`prorl_celery.integrations.live_batch`), so a long row does
not hold the others; a row leaves as soon as it is done. Each row keeps its own ``max_tokens``,
stop ids, ``min_tokens``, filters, temperature and seed (its own random generator when seeded).

**A row fails alone.** A row's sampling runs on its own logits (:mod:`...live_rows`); when
its settings leave no finite distribution it ends with :class:`RowFault` (the request's fault:
the server answers 400) and the batch goes on. Non-finite logits from the model, or a forward
that raises, are the backend's fault (``ModelFault``, a 500); a prefill that raises is retried
row by row, so that a row whose prompt fails alone is the one refused.

**Logprobs** are those of the model's raw distribution (vLLM's default ``raw_logprobs``).

**Pause** (vLLM's semantics, see :mod:`prorl_celery.fakes.llm.pause_api`): ``keep`` parks the loop
between two forwards — :meth:`pause` returns once no forward is running, so the caller may write
the weights — and after :meth:`resume` the same rows go on, on the new weights; ``abort`` ends
the rows in flight with their tokens so far (``finish_reason`` ``abort``); ``wait`` returns once
they finished. In every mode no new row is admitted while paused. Each generated token is
stamped with the version name current when its logits were computed (:meth:`name_version`),
which the answer reports as vLLM's ``weight_versions`` spans.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from prorl_celery.errors import InvalidRequest
from prorl_celery.integrations.live_batch import DecodeBatch, cache_arg, failing_rows
from prorl_celery.integrations.live_rows import ModelFault, Row, RowFault, RowParams, generator_for, sample_rows

__all__ = ["LiveEngine", "ModelFault", "PauseMode", "Row", "RowFault", "RowParams"]

PauseMode = Literal["keep", "abort", "wait"]


class LiveEngine:
    """Continuously batched sampling from ``model`` (the trainer's own object) with a pause
    between forwards.

    ``lock`` is held for every forward pass: a caller that holds it (or has paused the engine)
    may change the weights. The engine never changes the model's train/eval flag (another thread
    is training it); models with dropout should not be served this way while training.
    ``steps`` counts forwards; ``batches`` has one record per decode loop, from a first row to no
    row left (rows, longest prompt, tokens, seconds, when it ended: for benchmarks).
    """

    def __init__(self, model: Any, pad_id: int, version: str = "default", window_s: float = 0.05,
                 max_batch: int = 64):
        self.model, self.pad_id, self.version = model, pad_id, version
        self.window_s, self.max_batch = window_s, max_batch
        self.lock = threading.Lock()
        self.steps = 0
        self.batches: list[dict[str, Any]] = []
        self._loop_rows: list[Row] = []  # the rows of the decode loop in progress
        self._loop_started = 0.0
        self._queue: queue.Queue[Row | None] = queue.Queue()
        self._state = threading.Condition()
        self._paused: PauseMode | None = None
        self._running: list[Row] = []
        self._stop = False
        self._shared: Any = None  # the random stream of unseeded rows
        self._forward_version = version
        self._arg: str | None = None  # the forward's name for the cache
        self._thread = threading.Thread(target=self._loop, name="live-engine", daemon=True)

    def start(self) -> LiveEngine:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._state:
            self._stop, self._paused = True, None
            self._state.notify_all()
        self._queue.put(None)  # wakes the loop

    # -- the caller's side ----------------------------------------------------------------------
    def submit(self, prompt: list[int], params: RowParams, timeout: float | None = None,
               cancelled: Callable[[], bool] | None = None) -> Row:
        """Sample for one request (blocks until its row is done); raises the row's error."""
        if self._stop:
            raise ModelFault("the engine stopped")
        row = Row(prompt=list(prompt), params=params, cancelled=cancelled)
        self._queue.put(row)
        if not row.done.wait(timeout):
            raise TimeoutError("the engine did not answer in time")
        if row.error is not None:
            raise row.error
        return row

    def pause(self, mode: PauseMode) -> None:
        """Returns once it is safe to write the weights (``keep``: no forward running; ``abort``:
        the rows in flight ended, with their tokens so far; ``wait``: they finished)."""
        with self._state:
            self._paused = mode
            self._state.notify_all()
        if mode in ("wait", "abort"):  # abort: the loop ends them at its next forward
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

    @property
    def alive(self) -> bool:
        """Whether the engine's thread is serving (False before :meth:`start` and after a crash)."""
        return self._thread.is_alive()

    # -- the engine's thread --------------------------------------------------------------------
    def _loop(self) -> None:
        batch: DecodeBatch | None = None
        while not self._stop:
            new = self._admit(batch)
            try:
                if new:
                    batch = self._start(batch, new)
                if batch is not None and batch.rows:
                    batch = self._advance(batch)
            except Exception as exc:  # noqa: BLE001 - a forward failed for all: every row gets it, the loop goes on
                fault = ModelFault(f"{type(exc).__name__}: {exc}")
                for row in (batch.rows if batch is not None else []) + new:
                    self._end(row, error=fault)
                batch = None
            if batch is not None and not batch.rows:
                batch = None
            if batch is None and self._loop_rows:
                self._record_loop()
            self._set_running(batch, [])
        for row in batch.rows if batch is not None else []:
            self._end(row, error=ModelFault("the engine stopped"))
        self._drain_queue()

    def _admit(self, batch: DecodeBatch | None) -> list[Row]:
        """The rows to start now: with none running, the first request and what arrives within
        ``window_s`` (blocking, then waiting while paused); with rows running, what has queued,
        unless paused or the batch cannot take rows in."""
        if batch is not None and batch.rows:
            if self._paused is not None or not batch.joinable:
                return []
            return self._take(self.max_batch - len(batch.rows), wait=False)
        rows = self._take(self.max_batch, wait=True)
        with self._state:  # a new batch starts only while not paused (any mode)
            self._state.wait_for(lambda: self._paused is None or self._stop)
        return [] if self._stop else rows

    def _take(self, room: int, wait: bool) -> list[Row]:
        rows: list[Row] = []
        if wait:
            first = self._queue.get()
            if first is None:
                return []
            rows.append(first)
        deadline = time.monotonic() + (self.window_s if wait else 0.0)
        while len(rows) < room:
            left = deadline - time.monotonic()
            try:
                row = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if row is None:
                break
            rows.append(row)
        return rows

    def _start(self, batch: DecodeBatch | None, new: list[Row]) -> DecodeBatch | None:
        """Prefill ``new``, sample each row's first id, and join the rows still going to ``batch``."""
        if not self._loop_rows:
            self._loop_started = time.monotonic()
        self._loop_rows.extend(new)
        if self._shared is None:
            import torch

            self._shared = torch.Generator().manual_seed(int(torch.initial_seed()) % (2**63))
        for row in new:
            row.admitted_step = self.steps
            try:
                row.generator = generator_for(row.params.seed, self._shared)
            except (RuntimeError, ValueError, OverflowError) as exc:
                self._end(row, error=InvalidRequest(f"seed: {exc}", field="seed"))
        new = [r for r in new if not r.done.is_set()]
        self._set_running(batch, new)
        group = self._prefill(new) if new else None
        if group is None:
            return batch
        self._sample_into(*group)
        if batch is None or not batch.rows:
            batch = group[0]
        elif group[0].rows:
            batch.join(group[0])
        return batch

    def _prefill(self, rows: list[Row]) -> tuple[DecodeBatch, Any] | None:
        """The rows prefilled as one batch. If that raises, each row is tried alone: the rows that
        fail where others did not are refused (their prompt is the fault) and the others prefilled
        again; rows that all fail get the model's fault. None: no row is left (rows a pause
        aborted end ``abort``)."""
        device = next(self.model.parameters()).device
        if self._arg is None:
            self._arg = cache_arg(self.model)
        try:
            out = DecodeBatch.prefill(rows, self.pad_id, device, self._arg, self._forward)
        except Exception as exc:  # noqa: BLE001 - find the row that failed
            failed = failing_rows(rows, self.pad_id, device, self._arg, self._forward) if len(rows) > 1 else []
            if failed is None:  # a pause aborted the search
                out = None
            elif 0 < len(failed) < len(rows):  # their own prompts: refused, the others go on
                for row, err in failed:
                    self._end(row, error=InvalidRequest(f"the prompt failed in the model: {type(err).__name__}: "
                                                        f"{err}", field="prompt"))
                return self._prefill([r for r in rows if not r.done.is_set()])
            else:  # all of them, or none alone: the model's fault
                for row in rows:
                    self._end(row, error=ModelFault(f"{type(exc).__name__}: {exc}"))
                return None
        self.steps += out is not None
        if out is None:
            for row in rows:
                self._end(row, "abort")
        return out

    def _advance(self, batch: DecodeBatch) -> DecodeBatch | None:
        """One decode step of every running row."""
        logits = batch.step(self._forward)
        if logits is None:  # aborted by a pause: the rows end with their tokens so far
            for row in batch.rows:
                self._end(row, "abort")
            return None
        self.steps += 1
        self._sample_into(batch, logits)
        return batch

    def _sample_into(self, batch: DecodeBatch, logits: Any) -> None:
        """Each row's next id (:func:`~.live_rows.sample_rows`); the rows that ended leave the batch."""
        tokens = sample_rows(batch.rows, logits, self._forward_version, self.steps)
        for i, token in enumerate(tokens):
            if token is not None:
                batch.last[i] = token
        batch.keep([not row.done.is_set() for row in batch.rows])

    def _record_loop(self) -> None:
        rows, self._loop_rows = self._loop_rows, []
        self.batches.append({"rows": len(rows), "prompt_len": max(len(r.prompt) for r in rows),
                             "tokens": sum(len(r.ids) for r in rows), "seconds": time.monotonic() - self._loop_started,
                             "ended": time.monotonic()})
        if len(self.batches) >= 10_000:  # a long-lived server keeps the recent ones
            del self.batches[:5_000]

    def _end(self, row: Row, reason: str | None = None, error: BaseException | None = None) -> None:
        row.end(self.steps, reason, error)

    def _set_running(self, batch: DecodeBatch | None, new: list[Row]) -> None:
        with self._state:
            self._running = (batch.rows if batch is not None else []) + [r for r in new if not r.done.is_set()]
            self._state.notify_all()

    def _drain_queue(self) -> None:
        while True:
            try:
                row = self._queue.get_nowait()
            except queue.Empty:
                return
            if row is not None:
                self._end(row, error=ModelFault("the engine stopped"))

    def _forward(self, **kwargs: Any) -> Any:
        """One forward pass under the lock, parked while paused in keep mode; None when an abort
        pause ends the rows in flight (a wait pause lets them run to their end)."""
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
                import torch

                with torch.no_grad():
                    return self.model(**kwargs)
