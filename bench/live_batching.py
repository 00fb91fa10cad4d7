"""The live-model backend (prorl_celery/integrations/serve.py): 32 completions of one group-sized
burst, decoded as batches (the default: requests arriving within 50 ms are prefilled together,
and what arrives while rows decode joins them between decode steps) versus one request at a time
(``max_batch`` 1), over HTTP on ``/inference/v1/generate``.

    python bench/live_batching.py [--requests 32] [--max-tokens 32]

Prints the wall time of each way and the load average; figures go to bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODEL_DIR = Path(os.environ.get("PRORL_SMOL_MODEL", Path.home() / ".cache/prorl-celery/smollm2-135m-f32"))


def burst(server, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    import requests

    auth = {"Authorization": f"Bearer {server.api_key}"}

    def one(prompt: list[int]) -> int:
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0,
                                                         "ignore_eos": True, "logprobs": 0}}
        resp = requests.post(f"{server.url}/inference/v1/generate", json=body, headers=auth, timeout=1800)
        resp.raise_for_status()
        return len(resp.json()["choices"][0]["token_ids"])

    started = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, prompts))
    return time.monotonic() - started, tokens


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prorl_celery.integrations.serve import LiveModelServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    numbers = [str(10000 + 7919 * i % 90000) for i in range(args.requests // 4)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Repeat this 5-digit number exactly: {x}"}],
                                       add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for x in numbers for _ in range(4)]
    for name, max_batch in (("batched", 64), ("one by one", 1)):
        server = LiveModelServer(model, tok, max_batch=max_batch).start()
        try:
            seconds, tokens = burst(server, prompts, args.max_tokens)
            sizes = [b["rows"] for b in server.engine.batches]
        finally:
            server.stop()
        print(f"{name:10s}: {args.requests} completions, {tokens} tokens in {seconds:.1f}s "
              f"({len(sizes)} decode loops, largest {max(sizes)} rows); load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
