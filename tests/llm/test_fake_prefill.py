"""The fake server's prefill model: uncached prompt tokens cost ``prefill_s`` each, a cached prefix
(16-token blocks of earlier prompts and responses) costs nothing, and the batch waits meanwhile."""
from __future__ import annotations

import threading
import time

import pytest

from prorl_celery.fakes.llm.engine import BatchEngine, LatencyModel, PrefixCache


@pytest.mark.unit
def test_prefix_cache_counts_whole_blocks_and_evicts_the_oldest():
    cache = PrefixCache(capacity=64)  # 4 blocks
    a = list(range(40))
    assert cache.cached(a) == 0
    cache.add(a)  # 2 whole blocks
    assert cache.cached(a) == 32 and cache.cached(a[:20]) == 16 and cache.cached([7] + a) == 0
    cache.add(list(range(100, 148)))  # 3 more blocks: a's second block (the least recently used) goes
    assert len(cache.blocks) == 4 and cache.cached(a) == 16


def test_uncached_prompt_tokens_cost_prefill_time():
    engine = BatchEngine(LatencyModel(step_s=0.01, capacity=4, prefill_s=0.002, cache_tokens=4096))
    prompt = list(range(1000, 1200))
    t = time.monotonic()
    assert engine.run(2, None, prompt, [5, 6])
    cold = time.monotonic() - t
    t = time.monotonic()
    assert engine.run(2, None, prompt + [5, 6] + list(range(16)), [7, 8])  # the next turn of the same rollout
    warm = time.monotonic() - t
    stats = engine.stats()
    assert stats["prompt_tokens"] == 200 + 218
    assert stats["prefilled_tokens"] == 200 + (218 - 192)  # 12 whole blocks of the 202 prompt + response tokens
    assert cold >= 200 * 0.002 and warm < cold / 4, (cold, warm)


def test_decoding_waits_while_another_sequence_prefills():
    engine = BatchEngine(LatencyModel(step_s=0.01, capacity=4, prefill_s=0.002))
    done: dict[str, float] = {}
    t0 = time.monotonic()

    def decode_only() -> None:
        engine.run(20, None, [1], [2])  # 1 prompt token, then 20 steps: ~0.2 s alone
        done["short"] = time.monotonic() - t0

    thread = threading.Thread(target=decode_only)
    thread.start()
    time.sleep(0.05)
    engine.run(1, None, list(range(300)), [3])  # 0.6 s of prefill in the middle of it
    thread.join()
    assert done["short"] >= 0.2 + 0.5, done
