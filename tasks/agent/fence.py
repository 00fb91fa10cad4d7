"""Per-turn staleness fencing: when the episode goes on, a turn whose tokens are more than
``max_staleness`` weight versions behind the current one is fenced.

``mask``: the turn stays in the conversation (its tool calls ran) and its tokens get loss mask 0
in the result. ``regenerate``: the latest turn, whose tool calls have not run yet, is generated
again on the current weights (its tokens are thrown away, counted) until it is fresh or
``max_regenerations`` is spent; an older stale turn can only be masked. A turn's lag is the
current version's ordinal less the oldest of its segments' (a version the service never saw
counts as fresh: nothing is known against it). Counts go to ``episode.data["staleness"]``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol

from prorl_celery.llm.models import Turn

Policy = Literal["mask", "regenerate"]


class Versions(Protocol):
    """Weight versions in order (:class:`prorl_celery.staleness.WeightVersions`)."""

    def current(self) -> int: ...

    def ordinals(self, names: Iterable[str | None]) -> dict[str, int]: ...


def turn_versions(turn: Turn) -> list[str | None]:
    if turn.weight_segments:
        return list(dict.fromkeys(seg.version for seg in turn.weight_segments))
    return [turn.weight_version]


class StalenessFence:
    def __init__(self, versions: Versions, max_staleness: int, policy: Policy = "mask",
                 max_regenerations: int = 3):
        self.versions, self.k, self.policy = versions, max_staleness, policy
        self.max_regenerations = max_regenerations

    def stats(self, data: dict[str, Any]) -> dict[str, Any]:
        return data.setdefault("staleness", {"max_staleness": self.k, "fence": self.policy, "masked_turns": [],
                                             "regenerated_turns": 0, "regenerated_tokens": 0, "max_lag": 0,
                                             "turn_versions": []})

    def _lags(self, turns: list[list[str | None]]) -> list[int]:
        ordinals = self.versions.ordinals(v for versions in turns for v in versions)
        current = self.versions.current()
        out = []
        for versions in turns:
            known = [ordinals[v] for v in versions if v in ordinals]
            out.append(max(0, current - min(known)) if known else 0)
        return out

    def fresh(self, turn: Turn, again: Callable[[], Turn], data: dict[str, Any]) -> Turn:
        """``regenerate``: the new turn generated again while it is stale (then recorded)."""
        stats = self.stats(data)
        tries = 0
        while self.policy == "regenerate" and tries < self.max_regenerations \
                and self._lags([turn_versions(turn)])[0] > self.k:
            stats["regenerated_turns"] += 1
            stats["regenerated_tokens"] += len(turn.response_ids or [])
            tries += 1
            turn = again()
        stats["turn_versions"].append(turn_versions(turn))
        return turn

    def fence(self, data: dict[str, Any]) -> list[int]:
        """Mask every recorded turn beyond the bound (the episode goes on, or ends); returns the
        turns masked now."""
        stats = self.stats(data)
        lags = self._lags(stats["turn_versions"])
        masked = set(stats["masked_turns"])
        new = [i for i, lag in enumerate(lags) if lag > self.k and i not in masked]
        stats["masked_turns"] = sorted(masked | set(new))
        stats["max_lag"] = max([stats["max_lag"], *lags])
        stats["max_lag_kept"] = max([0, *(lag for i, lag in enumerate(lags) if i not in masked and i not in new)])
        return new

