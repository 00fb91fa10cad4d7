"""A row of :class:`prorl_celery.integrations.live_engine.LiveEngine` (one request: its prompt,
sampling set and what it generated) and its sampling step: vLLM's meaning of each field, on the
row's own logits, so that no row's values can touch another's (:func:`sample_rows`).

The ranges below are what the HTTP layer admits (a value outside is a 400 naming the field):
inside them every step stays finite. ``temperature`` below :data:`GREEDY_BELOW` is greedy, as vLLM
treats it (dividing by it would overflow); ``repetition_penalty`` is bounded because the logits of
every seen id are divided or multiplied by it (``1e-300`` is 0 in float32, and the division made
the whole batch's probabilities ``inf``/``nan``). A step whose probabilities are still not finite
raises :class:`RowFault` for that row alone; non-finite logits are the model's fault
(:class:`ModelFault`).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prorl_celery.errors import InvalidRequest

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily
REPETITION_PENALTY_RANGE = (0.01, 100.0)
TEMPERATURE_MAX = 1e4  # beyond it every distribution is uniform to float32 anyway
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


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


class RowFault(ValueError):
    """This row's own sampling gave no usable distribution (its neighbours are not affected)."""


class ModelFault(RuntimeError):
    """The model itself failed (a forward raised, or gave non-finite logits): the backend's fault."""


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
    cancelled: Callable[[], bool] | None = None  # the caller hung up: the row ends at the next step
    admitted_step: int | None = None  # the engine's forward count when the row was prefilled
    finished_step: int | None = None  # ... and when it ended

    def spans(self) -> list[dict[str, Any]]:
        """vLLM's ``weight_versions``: ``[{"version", "start", "end"}]`` over the generated ids."""
        out: list[dict[str, Any]] = []
        for i, version in enumerate(self.versions):
            if out and out[-1]["version"] == version:
                out[-1]["end"] = i + 1
            else:
                out.append({"version": version, "start": i, "end": i + 1})
        return out

    def end(self, step: int, reason: str | None = None, error: BaseException | None = None) -> None:
        """The row is done (once: its caller may already be reading it)."""
        if self.done.is_set():
            return
        self.finish_reason = reason or self.finish_reason or "error"
        self.error, self.finished_step = error, step
        self.done.set()

    def append(self, token: int, logprob: float, version: str, step: int) -> None:
        """One generated id; ends the row at a stop id or at ``max_tokens``."""
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.params.stop_ids:  # masked out before min_tokens
            self.end(step, "stop")
        elif len(self.ids) >= self.params.max_tokens:
            self.end(step, "length")


def sample_rows(rows: list[Row], logits: Any, version: str, step: int) -> list[int | None]:
    """Each row's next id from its own logits (``logits[i]`` for ``rows[i]``), stamped ``version``;
    None for a row that ended without one: its caller hung up (``abort``), the model gave it
    non-finite logits (:class:`ModelFault`), or its own settings failed (a 400 naming
    ``sampling_params``). The other rows are not affected."""
    import torch

    finite = torch.isfinite(logits).all(dim=-1).tolist()
    out: list[int | None] = []
    for i, row in enumerate(rows):
        token = None
        if row.cancelled is not None and row.cancelled():
            row.end(step, "abort")
        elif not finite[i]:
            row.end(step, error=ModelFault("the model gave non-finite logits"))
        else:
            try:
                token, logprob = sample(row.params, row.prompt, row.ids, logits[i], row.generator)
            except RowFault as exc:
                row.end(step, error=InvalidRequest(str(exc), field="sampling_params"))
            else:
                row.append(token, logprob, version, step)
        out.append(token)
    return out


def sample(params: RowParams, prompt: list[int], ids: list[int], logits: Any, generator: Any) -> tuple[int, float]:
    """One id from the row's raw ``logits`` (1-D) and that id's raw logprob (before temperature or
    any filter: vLLM's ``raw_logprobs``), after the row's ``prompt`` and the ``ids`` it generated."""
    import torch

    raw = torch.log_softmax(logits, dim=-1)
    work = logits.clone()
    if len(ids) < params.min_tokens and params.stop_ids:
        work[list(params.stop_ids)] = float("-inf")
    if params.repetition_penalty != 1.0:  # transformers' rule, over the prompt and what was generated
        seen = torch.tensor(sorted(set(prompt) | set(ids)), dtype=torch.long, device=work.device)
        vals = work[seen]
        work[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if params.temperature < GREEDY_BELOW:
        token = int(torch.argmax(work))
        return token, float(raw[token])
    probs = _filtered(params, work / params.temperature)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        raise RowFault("the row's sampling settings left no finite distribution")
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(raw[token])


def _filtered(params: RowParams, work: Any) -> Any:
    """Probabilities after top-k, top-p and min-p (vLLM's order)."""
    import torch

    if params.top_k and 0 < params.top_k < work.numel():
        kth = torch.topk(work, params.top_k).values[-1]
        work[work < kth] = float("-inf")
    probs = torch.softmax(work, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop = cumulative - sorted_probs > params.top_p  # keep the smallest head reaching top_p
        probs[order[drop]] = 0.0
    if params.min_p > 0:
        probs[probs < params.min_p * probs.max()] = 0.0
    return probs


def generator_for(seed: int | None, shared: Any) -> Any:
    """The row's random stream: its own when seeded, else ``shared`` (the engine's; the trainer's
    global stream is never drawn from)."""
    import torch

    if seed is None:
        return shared
    return torch.Generator().manual_seed(int(seed))
