"""The live-model backend under the service (``pytest -m trainer``): requests that arrive together
are decoded in one batch with honest logprobs, and the service's ``pause("keep")`` freezes a turn
in the middle of its tokens, which then goes on after ``resume`` — its tokens saying which
weights sampled them, before and after the update.
"""
from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.trainers.test_trl import trl_installed  # noqa: F401 - the install fixture

pytestmark = [pytest.mark.trainer, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def live(trl_installed):  # noqa: F811
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.trl_grpo import MODEL_DIR
    from prorl_celery.integrations.serve import LiveModelServer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    server = LiveModelServer(model, tok, window_s=0.3).start()
    yield server, tok, model
    server.stop()


def _generate(server, prompt, **params):
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 8, "temperature": 1.0, "logprobs": 0, **params}}
    resp = requests.post(f"{server.url}/inference/v1/generate", json=body, timeout=300,
                         headers={"Authorization": f"Bearer {server.api_key}"})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_a_burst_is_one_batch_with_each_rows_raw_logprobs(live):
    import torch

    server, tok, model = live
    prompts = [tok.encode("The capital of France is"), tok.encode("Once upon a time, in a land far away, there")] * 2
    answers: list = [None] * len(prompts)
    before = len(server.engine.batches)
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, _generate(server, prompts[i], seed=i)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batches = server.engine.batches[before:]
    assert max(b["rows"] for b in batches) >= 2  # arrived together, decoded together (left-padded)
    for prompt, answer in zip(prompts, answers):
        ids = answer["token_ids"]
        with torch.no_grad():
            scores = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), dim=-1)
        rescored = [scores[len(prompt) - 1 + k, t].item() for k, t in enumerate(ids)]
        got = [e["logprob"] for e in answer["logprobs"]["content"]]
        assert max(abs(a - b) for a, b in zip(rescored, got)) < 1e-3
    alone = _generate(server, prompts[1], seed=1)  # a seeded row samples the same, batched or alone
    assert alone["token_ids"] == answers[1]["token_ids"]
    refused = requests.post(f"{server.url}/inference/v1/generate", timeout=30,
                            json={"token_ids": prompts[0], "sampling_params": {"n": 2}},
                            headers={"Authorization": f"Bearer {server.api_key}"})
    assert refused.status_code == 400 and refused.json()["error"]["field"] == "sampling_params.n"


def test_keep_pause_through_the_service_freezes_a_turn_and_versions_its_tokens(live, stack, api):
    from examples.trl_grpo import MODEL_DIR
    from prorl_celery.client import ProrlClient

    server, _, _ = live
    requests.post(f"{api}/clear_llm_server", timeout=10)
    client = ProrlClient(stack.api_url, token=stack.api_token)
    backend = server.register(client, tokenizer=str(MODEL_DIR), weight_version="v1")
    assert backend["pause_api"] == "vllm" and backend["dialect"] == "vllm-generate"
    try:
        for _ in range(4):  # a sample may end before the pause lands; try another
            story = {"data_source": "echo", "text": "dragon", "prompt": "Write a long story about a dragon."}
            job = client.submit(story,
                                sampling_params={"max_turns": 1, "max_tokens": 48, "temperature": 1.0,
                                                 "token_level_generation": True,
                                                 "tokenizer": str(MODEL_DIR)})
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not any(len(r.ids) >= 3 for r in server.engine._running):
                time.sleep(0.02)
            paused = client.pause("keep", ids=[backend["id"]])
            assert paused["safe"] and paused["modes"] == {backend["id"]: "keep"}
            row = next((r for r in server.engine._running if r.finish_reason is None), None)
            time.sleep(0.3)  # the logits of the last forward before the pause still give their token (old weights)
            frozen_at = len(row.ids) if row else None
            time.sleep(1.0)
            still = len(row.ids) if row else None
            mid_turn = row is not None and row.finish_reason is None  # frozen with tokens still to come
            client.resume(ids=[backend["id"]], weight_version="v2")
            view = client.wait(job, timeout=300)
            assert view["status"] == "completed", view
            if not mid_turn:
                continue
            assert still == frozen_at  # nothing was sampled while paused
            versions = view["result"]["token_versions"]
            generated = [v for v in versions if v is not None]
            assert generated[:frozen_at] == ["v1"] * frozen_at and set(generated[frozen_at:]) == {"v2"}
            message = next(m for m in view["result"]["messages"] if m["role"] == "assistant")
            assert [s["version"] for s in message["weight_segments"]] == ["v1", "v2"]
            return
        pytest.fail("no sample was still generating when the pause landed, in 4 tries")
    finally:
        requests.post(f"{api}/clear_llm_server", timeout=10)
