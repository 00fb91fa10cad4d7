"""One backoff for every retry loop of ours: the trainer's client (an answer of 502/503/504, a
refused connection), the LLM pool (a failed call, retried on another backend) and sandbox
placement (every host full, an image being pulled).

The pause before retry ``n`` (1, 2, ...) is ``first_s * 2 ** (n - 1)``, at most ``max_s``, times a
factor drawn from ``jitter``: a thousand callers that failed together then do not knock again
together. A loop asks :meth:`Backoff.pause` for it and waits it out with :func:`wait`, which a
``stop`` callable (a cancelled job) cuts short.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Doubling pauses from ``first_s`` up to ``max_s``, each scaled by a factor drawn uniformly
    from ``jitter`` (``(1.0, 1.0)``: none)."""

    first_s: float
    max_s: float
    jitter: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self) -> None:
        low, high = self.jitter
        if not (0 <= self.first_s and 0 <= self.max_s and 0 <= low <= high):
            raise ValueError(f"backoff needs first_s, max_s >= 0 and 0 <= jitter low <= high: {self}")

    def base(self, retry: int) -> float:
        """The pause before retry ``retry`` (1-based), before jitter."""
        if retry < 1:
            raise ValueError(f"retries count from 1, not {retry}")
        return min(self.first_s * 2.0 ** min(retry - 1, 64), self.max_s)

    def pause(self, retry: int) -> float:
        """The jittered pause before retry ``retry`` (1-based)."""
        return self.base(retry) * random.uniform(*self.jitter)


def wait(seconds: float, stop: Callable[[], bool] | None = None, poll_s: float = 0.1) -> bool:
    """Sleep ``seconds``; with ``stop``, look at it every ``poll_s`` and return early once it is
    true. Returns whether the whole pause passed (False: stopped)."""
    if stop is None:
        time.sleep(max(seconds, 0.0))
        return True
    end = time.monotonic() + seconds
    while not stop():
        left = end - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(left, poll_s))
    return False
