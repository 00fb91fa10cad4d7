"""How the fake serves a call beyond its ids, in the real servers' fields (see
:mod:`prorl_celery.llm.dialects.served` for where each server puts them):

- its prefix-cache hit (the engine's block cache, :class:`prorl_celery.fakes.llm.engine.PrefixCache`,
  whole blocks of 16 tokens as vLLM's; one of :data:`CACHE_TOKENS` for reporting where the latency
  model keeps none), reported as ``cached_tokens`` where the server it plays reports one;
- a MoE routing trace (``--routed-experts LAYERSxTOPK``, as a server started with
  ``--enable-return-routed-experts`` on a MoE model): for each generated token, for each layer,
  ``TOPK`` distinct expert ids out of :data:`EXPERTS`, drawn from the token, its position and the
  layer. A test reads the trace the fake sent from its debug record, never recomputes it.
"""
from __future__ import annotations

import base64
import hashlib
import struct

EXPERTS = 64
CACHE_TOKENS = 1 << 20


def routes(ids: list[int], layers: int, topk: int, start: int = 0) -> list[list[list[int]]]:
    """The trace of ``ids`` (generated at positions ``start``...): vLLM's layout, token x layer x top-k."""
    out = []
    for pos, token in enumerate(ids, start):
        per_layer = []
        for layer in range(layers):
            digest = hashlib.blake2b(f"{token}:{pos}:{layer}".encode(), digest_size=16).digest()
            picked: list[int] = []
            for byte in digest:
                if byte % EXPERTS not in picked:
                    picked.append(byte % EXPERTS)
                if len(picked) == topk:
                    break
            per_layer.append(picked)
        out.append(per_layer)
    return out


def packed(trace: list[list[list[int]]]) -> str:
    """SGLang's encoding of a trace: the base64 of its int32 ids, token, layer, top-k order."""
    flat = [e for token in trace for layer in token for e in layer]
    return base64.b64encode(struct.pack(f"<{len(flat)}i", *flat)).decode()


def parse_shape(value: str) -> tuple[int, int]:
    """``"LAYERSxTOPK"`` -> (layers, topk)."""
    layers, _, topk = value.lower().partition("x")
    shape = (int(layers), int(topk))
    if shape[0] < 1 or not 1 <= shape[1] <= 16:
        raise ValueError(f"--routed-experts {value!r}: LAYERSxTOPK, layers >= 1, 1 <= topk <= 16")
    return shape
