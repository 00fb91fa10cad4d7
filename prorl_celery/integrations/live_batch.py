"""The rows :class:`prorl_celery.integrations.live_engine.LiveEngine` decodes together, as tensors:
one key/value cache, the attention mask over its columns, each row's next position and last id.

Rows come and go between decode steps (continuous batching): a new group is prefilled on its own
(:meth:`DecodeBatch.prefill`, left-padded, one forward) and then joined to the running batch
(:meth:`DecodeBatch.join`: the shorter cache is left-padded to the longer, the padding masked
out); a finished row leaves at once (:meth:`DecodeBatch.keep`), and columns that are padding for
every row left are trimmed. Positions are per row, so a row's ids, logits and logprobs are the
same batched or alone. Joining needs plain ``DynamicCache`` layers (full attention); a model with
sliding-window or other layers reports :attr:`DecodeBatch.joinable` False, and the engine then
admits new rows only when the running ones are done.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

Forward = Callable[..., Any]  # the model's forward under the engine's lock; None when a pause aborted it


def cache_arg(model: Any) -> str:
    """The forward's name for the key/value cache: ``cache`` (transformers >= 5.2x), else
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class DecodeBatch:
    """Rows ``rows[i]`` at batch index ``i`` of every tensor."""

    def __init__(self, rows: list[Any], cache: Any, mask: Any, positions: Any, arg: str):
        import torch

        self.rows, self.cache, self.mask, self.positions, self.arg = rows, cache, mask, positions, arg
        self.last = torch.zeros(len(rows), dtype=torch.long, device=mask.device)

    @classmethod
    def prefill(cls, rows: list[Any], pad_id: int, device: Any, arg: str,
                forward: Forward) -> tuple[DecodeBatch, Any] | None:
        """The rows' prompts through the model at once (left-padded): the batch and each row's
        logits for its first id (float32, one row each), or None when a pause aborted it."""
        import torch
        from transformers import DynamicCache

        width = max(len(r.prompt) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row.prompt):] = torch.tensor(row.prompt)
            mask[i, width - len(row.prompt):] = 1
        ids, mask = ids.to(device), mask.to(device)
        cache = DynamicCache()
        out = forward(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                      use_cache=True, logits_to_keep=1, **{arg: cache})
        if out is None:
            return None
        return cls(rows, cache, mask, mask.sum(-1), arg), out.logits[:, -1, :].float()

    def step(self, forward: Forward) -> Any:
        """One forward of every row's last id: each row's logits for its next id, or None when a
        pause aborted it (the batch is then unchanged)."""
        import torch

        mask = torch.cat([self.mask, torch.ones((len(self.rows), 1), dtype=self.mask.dtype,
                                                device=self.mask.device)], dim=-1)
        out = forward(input_ids=self.last.view(-1, 1), attention_mask=mask, position_ids=self.positions.view(-1, 1),
                      use_cache=True, **{self.arg: self.cache})
        if out is None:
            return None
        self.mask, self.positions = mask, self.positions + 1
        return out.logits[:, -1, :].float()

    @property
    def joinable(self) -> bool:
        """Whether another batch's cache can be joined to this one's (plain full-attention layers)."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    def join(self, other: DecodeBatch) -> None:
        """Take ``other``'s rows in after this batch's (their caches left-padded to one width)."""
        import torch
        import torch.nn.functional as F

        width = max(self.mask.shape[1], other.mask.shape[1])
        pads = (width - self.mask.shape[1], width - other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            if getattr(mine, "keys", None) is None or getattr(theirs, "keys", None) is None:
                continue
            mine.keys = torch.cat([F.pad(mine.keys, (0, 0, pads[0], 0)), F.pad(theirs.keys, (0, 0, pads[1], 0))])
            mine.values = torch.cat([F.pad(mine.values, (0, 0, pads[0], 0)),
                                     F.pad(theirs.values, (0, 0, pads[1], 0))])
        self.mask = torch.cat([F.pad(self.mask, (pads[0], 0)), F.pad(other.mask, (pads[1], 0))])
        self.positions = torch.cat([self.positions, other.positions])
        self.last = torch.cat([self.last, other.last])
        self.rows = self.rows + other.rows

    def keep(self, keep: list[bool]) -> None:
        """Only the rows marked True stay; columns that are padding for all of them go."""
        import torch

        if all(keep):
            return
        index = torch.tensor([i for i, k in enumerate(keep) if k], dtype=torch.long, device=self.mask.device)
        self.rows = [r for r, k in zip(self.rows, keep) if k]
        self.cache.batch_select_indices(index)
        self.mask, self.positions, self.last = self.mask[index], self.positions[index], self.last[index]
        used = self.mask.any(0).nonzero()
        first = int(used[0]) if len(used) else self.mask.shape[1]
        if first > 0 and self.joinable:  # a left column no row attends to: drop it (sliding layers keep theirs)
            self.mask = self.mask[:, first:]
            for layer in getattr(self.cache, "layers", []):
                if getattr(layer, "keys", None) is not None and layer.keys.numel():
                    layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]


def failing_rows(rows: list[Any], pad_id: int, device: Any, arg: str,
                 forward: Forward) -> list[tuple[Any, Exception]] | None:
    """Which of ``rows`` fail their prefill on their own (after their batch's prefill raised):
    each row prefilled alone, the result dropped (a failure's path, not worth a join). None when
    a pause aborted the search."""
    failed: list[tuple[Any, Exception]] = []
    for row in rows:
        try:
            if DecodeBatch.prefill([row], pad_id, device, arg, forward) is None:
                return None
        except Exception as exc:  # noqa: BLE001 - this row's own failure, told to the caller
            failed.append((row, exc))
    return failed
