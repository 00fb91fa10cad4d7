"""The live-model backend (prorl_celery/integrations/serve.py) beside a hostile row, over HTTP on
``/inference/v1/generate`` with SmolLM2-135M on the CPU:

- ``quiet``: honest calls (16 tokens each), one after another, nothing else running;
- ``long``: the same honest calls sent while one call asks for ``--long-tokens`` tokens (what a
  call without ``max_tokens`` asks through the pool: the room its context leaves);
- ``sampling``: a burst of honest calls sent together with one ``repetition_penalty: 1e-300`` row.

For each: the honest calls' latencies (median, max), how many failed, what the hostile call got,
and the load average (the machine is shared: read the figures beside it).

    python bench/live_hostile.py [--honest 4] [--long-tokens 512] [--threads 1]

``--threads``: torch's intra-op threads (1 by default: on two cores shared with other work, two
threads per forward were ten times slower than one).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODEL_DIR = Path(os.environ.get("PRORL_SMOL_MODEL", Path.home() / ".cache/prorl-celery/smollm2-135m-f32"))


def call(server, prompt: list[int], **params) -> tuple[float, int, dict]:
    """One generate call: seconds, status, body."""
    import requests

    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 16, "temperature": 1.0, "ignore_eos": True,
                                                     "logprobs": 0, **params}}
    started = time.monotonic()
    resp = requests.post(f"{server.url}/inference/v1/generate", json=body, timeout=3600,
                         headers={"Authorization": f"Bearer {server.api_key}"})
    return time.monotonic() - started, resp.status_code, resp.json()


def report(name: str, honest: list[tuple[float, int, dict]], extra: str = "") -> None:
    seconds = [s for s, status, _ in honest if status == 200]
    failed = sum(1 for _, status, _ in honest if status != 200)
    spread = f"median {statistics.median(seconds):.2f}s, max {max(seconds):.2f}s" if seconds else "none answered"
    print(f"{name:9s}: {len(honest)} honest calls, {spread}, {failed} failed{extra}; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)


def quiet(server, prompt: list[int], n: int) -> None:
    report("quiet", [call(server, prompt) for _ in range(n)])


def long_beside(server, prompt: list[int], n: int, long_tokens: int) -> None:
    box: dict = {}
    worker = threading.Thread(target=lambda: box.setdefault("long", call(server, prompt, max_tokens=long_tokens)))
    worker.start()
    time.sleep(1.0)  # the long call is decoding
    honest, before = [], 0
    for _ in range(n):
        honest.append(call(server, prompt))
        before += worker.is_alive()
    worker.join()
    seconds, status, body = box["long"]
    got = len(body["choices"][0]["token_ids"]) if status == 200 else body
    report("long", honest, f" ({before} answered while the long call ran); the long call: {status}, "
                           f"{got} tokens in {seconds:.1f}s")


def sampling(server, prompt: list[int], n: int) -> None:
    with ThreadPoolExecutor(n + 1) as pool:
        hostile = pool.submit(call, server, prompt, repetition_penalty=1e-300)
        honest = list(pool.map(lambda _: call(server, prompt), range(n)))
    seconds, status, body = hostile.result()
    said = body.get("error", {}).get("message", "200")[:80] if status != 200 else "200"
    report("sampling", honest, f"; the hostile row: {status} {said!r}")


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prorl_celery.integrations.serve import LiveModelServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--honest", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a story about a dragon."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    server = LiveModelServer(model, tok, max_tokens=args.long_tokens) if _takes_cap() else LiveModelServer(model, tok)
    server.start()
    try:
        call(server, prompt)  # warm up
        quiet(server, prompt, args.honest)
        long_beside(server, prompt, args.honest, args.long_tokens)
        sampling(server, prompt, args.honest)
    finally:
        server.stop()


def _takes_cap() -> bool:
    """Whether this checkout's server has a per-call cap (it must not cut the long call here)."""
    import inspect

    from prorl_celery.integrations.serve import LiveModelServer

    return "max_tokens" in inspect.signature(LiveModelServer).parameters


if __name__ == "__main__":
    main()
