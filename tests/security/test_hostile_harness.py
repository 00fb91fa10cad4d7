"""Issue 32: the harness is the attacker. What sits behind the sandbox's socket (the gateway, the
relay, the live server, the graders) holds against model-controlled input; one section per area,
each test failing on the code before its fix.
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

# --- live ---
# The trainer's live model server (prorl_celery/integrations/serve.py, live_engine.py) on a tiny
# random model (tests/security/hostile_live.py): a hostile row is refused or ends alone, the pool does
# not quarantine the backend for it, and a long row does not hold the others.
from tests.security.hostile_live import VOCAB, generate, live_server  # noqa: E402


@pytest.fixture(scope="module")
def live():
    yield from live_server()


def _finite_answer(resp, tokens: int) -> None:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert len(choice["token_ids"]) == tokens
    assert all(math.isfinite(e["logprob"]) for e in choice["logprobs"]["content"])


def test_live_a_hostile_sampling_row_does_not_fail_its_neighbours(live):
    """Sent in one burst (decoded together before the fix), the honest rows are answered in full
    with finite logprobs; each hostile row is refused with a 400 naming its field, or, a near-zero
    temperature, sampled greedily as vLLM does. Before: ``repetition_penalty: 1e-300`` (0 in float32)
    made the batch's probabilities nan and every row of it a 500."""
    hostile = [({"repetition_penalty": 1e-300}, "sampling_params.repetition_penalty"),
               ({"repetition_penalty": 1e300}, "sampling_params.repetition_penalty"),
               ({"seed": 2**70}, "sampling_params.seed"),  # beyond what a torch generator takes
               ({"stop_token_ids": [VOCAB + 5]}, "sampling_params.stop_token_ids"),
               ({"stop_token_ids": [-1]}, "sampling_params.stop_token_ids")]
    prompt = [1, 2, 3, 4, 5]
    with ThreadPoolExecutor(12) as pool:
        honest = [pool.submit(generate, live, prompt, seed=i, ignore_eos=True) for i in range(4)]
        refused = [(pool.submit(generate, live, prompt, **params), field) for params, field in hostile]
        out_of_vocab = pool.submit(generate, live, [1, VOCAB + 7, 2])
        greedy = [pool.submit(generate, live, prompt, temperature=t, ignore_eos=True) for t in (1e-40, 0.0)]
    for future in honest:
        _finite_answer(future.result(), 8)
    for future, field in refused:
        resp = future.result()
        assert resp.status_code == 400 and resp.json()["error"]["field"] == field, resp.text
    resp = out_of_vocab.result()
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "token_ids", resp.text
    tiny, zero = (f.result() for f in greedy)
    _finite_answer(tiny, 8)
    assert tiny.json()["choices"][0]["token_ids"] == zero.json()["choices"][0]["token_ids"]


def test_live_a_row_that_faults_in_the_engine_ends_alone():
    """Past the HTTP checks (values let into the engine directly, in one burst: one batch), a row
    whose settings leave no finite distribution, and a row whose prompt fails in the model, each
    end alone with the request's error (a 400 naming the field); the rows beside them go on.
    Before: the whole batch failed with the bad row's ``RuntimeError`` or ``IndexError``."""
    from prorl_celery.errors import InvalidRequest
    from prorl_celery.integrations.live_engine import RowParams

    rows = {f"honest{i}": ([1, 2, 3, 4, 5], RowParams(max_tokens=8, seed=i)) for i in range(3)}
    rows["sampling"] = ([1, 2, 3, 4, 5], RowParams(max_tokens=8, repetition_penalty=1e-300))
    rows["prompt"] = ([1, VOCAB + 50, 2], RowParams(max_tokens=8))
    results: dict[str, object] = {}
    for server in live_server(window_s=1.0):  # a window wide enough that the burst is one batch
        def run(name: str, prompt: list[int], params: RowParams) -> None:
            try:
                results[name] = server.engine.submit(prompt, params, timeout=120)
            except Exception as exc:  # noqa: BLE001 - what the row got is what is asserted
                results[name] = exc

        threads = [threading.Thread(target=run, args=(name, *item)) for name, item in rows.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
    for name, field in (("sampling", "sampling_params"), ("prompt", "prompt")):
        assert isinstance(results[name], InvalidRequest) and results[name].field == field, results[name]
    for i in range(3):
        row = results[f"honest{i}"]
        assert not isinstance(row, Exception), row
        assert len(row.ids) == 8 and all(math.isfinite(lp) for lp in row.logprobs)


def test_live_the_backend_is_not_quarantined_for_a_requests_fault(live, redis_url, monkeypatch):
    """Through the LLM pool (the gateway's path to the backend): the hostile call is refused (no
    retry), the honest calls beside it are answered at their first attempt, and the backend stays
    in rotation with no failure counted. Before: every row of the batch got a 500, so the pool
    quarantined the backend and retried the honest calls."""
    import redis

    from config.settings import get_settings
    from prorl_celery.errors import LLMRequestRejected
    from prorl_celery.llm import BackendSpec, BackendStatus, LLMPool, LLMRequest, SamplingParams

    for name, value in {"llm_backoff_s": 0.05, "llm_probe_period_s": 0.3, "llm_retry_budget": 2}.items():
        monkeypatch.setattr(get_settings(), name, value)
    pool = LLMPool(redis.Redis.from_url(redis_url))
    pool.registry.clear()
    backend, _ = pool.registry.add(BackendSpec(address=live.url, protocol="generate", dialect="vllm-generate",
                                               model=live.name, api_key=live.api_key, tokenizer="byte",
                                               max_model_len=live.max_model_len, capacity=16))
    messages = [{"role": "user", "content": "Say ok."}]

    def ask(i: int, **sampling):
        return pool.generate(f"live-{i}", LLMRequest(messages=messages, sampling=SamplingParams(max_tokens=6,
                                                                                              **sampling)))
    try:
        with ThreadPoolExecutor(5) as ex:
            hostile = ex.submit(ask, 99, repetition_penalty=1e-300)
            honest = list(ex.map(lambda i: ask(i, seed=i), range(4)))
        with pytest.raises(LLMRequestRejected, match="repetition_penalty"):
            hostile.result()
        assert all(turn.attempts == 1 and turn.backend_id == backend.id for turn in honest)
        record = pool.registry.get(backend.id)
        assert record.status is BackendStatus.ACTIVE and record.failures == 0, record
    finally:
        pool.registry.clear()


def test_live_a_long_row_does_not_hold_the_others(live):
    """One call asks for 4,000 tokens; calls sent while it decodes are admitted between its decode
    steps and answered while it still runs (an order, not a time: they need tens of its steps).
    Before: a batch ran to its longest row, so every later call waited for all of it. The long
    call is then ended by an abort pause, answered with its tokens so far."""
    box: dict = {}
    long_call = threading.Thread(target=lambda: box.setdefault(
        "long", generate(live, [7] * 20, max_tokens=4000, ignore_eos=True, timeout=600)))
    long_call.start()
    deadline = time.monotonic() + 120
    while not any(len(r.ids) >= 2 for r in list(live.engine._running)) and time.monotonic() < deadline:
        time.sleep(0.005)  # the long row is decoding (the engine's rows in flight, as tests/trainers read them)
    try:
        with ThreadPoolExecutor(3) as ex:
            short = list(ex.map(lambda i: generate(live, [1, 2, 3 + i], seed=i, ignore_eos=True, timeout=600),
                                range(3)))
        assert long_call.is_alive()  # answered while the long call still decodes
        for resp in short:
            _finite_answer(resp, 8)
    finally:
        live.pause("abort")
        live.resume()
        long_call.join(600)
    answer = box["long"].json()["choices"][0]
    assert answer["finish_reason"] == "abort" and 0 < len(answer["token_ids"]) < 4000


def test_live_a_call_without_a_cap_ends_at_the_servers():
    """A call asking the whole context (what a call without ``max_tokens`` asks through the pool)
    ends at the server's per-call cap (the ``live_max_tokens`` setting, or the server's own)."""
    for server in live_server(max_tokens=16):
        resp = generate(server, [1, 2, 3], max_tokens=10**6, ignore_eos=True)
        assert resp.status_code == 200 and len(resp.json()["choices"][0]["token_ids"]) == 16, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "length"
