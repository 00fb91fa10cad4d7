"""The live model server (prorl_celery/integrations/serve.py) on a tiny random Llama, under ``-m
trainer`` (it needs torch: ``bash scripts/install-trainers.sh``; a decode step takes about a
millisecond): rows joined to a batch in
flight sample what they sample alone, the pause modes between decode steps, a caller that hangs up
frees its row, and the HTTP routes (tests/trainers/test_live_server.py does the same on SmolLM2,
through the service, under ``-m trainer``).
"""
from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.security.hostile_live import generate, live_server

pytestmark = pytest.mark.trainer


@pytest.fixture(scope="module")
def live():
    yield from live_server()


def _wait(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _decoding(live, ids: int = 2) -> list:
    _wait(lambda: any(len(r.ids) >= ids for r in list(live.engine._running)), "a row decoding")
    return [r for r in list(live.engine._running) if len(r.ids) >= ids]


def _choice(resp) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_rows_joined_in_flight_sample_what_they_sample_alone(live):
    """Seeded rows with different prompt lengths (the batch's cache left-padded to the longest)
    give the same ids and logprobs joined to a running row as alone, and so does the running row."""
    long_prompt, shorts = list(range(1, 40)), [[5, 6], [9] * 20, list(range(100, 170))]
    sampling = {"ignore_eos": True, "repetition_penalty": 1.2, "top_k": 50}
    long_alone = _choice(generate(live, long_prompt, seed=99, max_tokens=80, **sampling))
    alone = [_choice(generate(live, p, seed=i, max_tokens=10, **sampling)) for i, p in enumerate(shorts)]
    box: dict = {}
    runner = threading.Thread(target=lambda: box.setdefault(
        "long", _choice(generate(live, long_prompt, seed=99, max_tokens=80, **sampling))))
    runner.start()
    _decoding(live, 5)
    joined: list = [None] * len(shorts)
    threads = [threading.Thread(target=lambda i=i: joined.__setitem__(
        i, _choice(generate(live, shorts[i], seed=i, max_tokens=10, **sampling)))) for i in range(len(shorts))]
    for t in threads:
        t.start()
        time.sleep(0.01)  # arrive at different steps
    for t in threads:
        t.join(120)
    runner.join(120)
    for got, want in zip(joined + [box["long"]], alone + [long_alone]):
        assert got["token_ids"] == want["token_ids"]
        lps = [(a["logprob"], b["logprob"]) for a, b in zip(got["logprobs"]["content"], want["logprobs"]["content"])]
        assert max(abs(a - b) for a, b in lps) < 1e-4


def test_keep_pause_freezes_rows_between_steps_and_stamps_versions(live):
    box: dict = {}
    runner = threading.Thread(target=lambda: box.setdefault(
        "row", _choice(generate(live, [3, 4, 5], max_tokens=100, ignore_eos=True))))
    live.engine.name_version("v1")
    runner.start()
    (row,) = _decoding(live, 3)
    live.pause("keep")
    time.sleep(0.2)  # the logits of the last forward before the pause still give their token (old weights)
    frozen = len(row.ids)
    late = threading.Thread(target=lambda: box.setdefault("late", _choice(generate(live, [8, 9], max_tokens=4))))
    late.start()  # arrives while paused: waits
    time.sleep(0.3)
    assert len(row.ids) == frozen and "late" not in box
    live.engine.name_version("v2")
    live.resume()
    runner.join(120)
    late.join(120)
    spans = box["row"]["weight_versions"]
    assert [s["version"] for s in spans] == ["v1", "v2"] and spans[0]["end"] == frozen
    assert box["late"]["weight_versions"] == [{"version": "v2", "start": 0, "end": 4}]


def test_abort_pause_ends_rows_with_their_tokens_and_wait_pause_lets_them_finish(live):
    box: dict = {}
    runner = threading.Thread(target=lambda: box.setdefault(
        "aborted", _choice(generate(live, [3, 4, 5], max_tokens=3000, ignore_eos=True))))
    runner.start()
    _decoding(live, 3)
    live.pause("abort")  # returns once the row ended
    assert not live.engine._running
    live.resume()
    runner.join(120)
    assert box["aborted"]["finish_reason"] == "abort" and 3 <= len(box["aborted"]["token_ids"]) < 3000
    runner = threading.Thread(target=lambda: box.setdefault(
        "waited", _choice(generate(live, [3, 4, 5], max_tokens=60, ignore_eos=True))))
    runner.start()
    _decoding(live, 2)
    live.pause("wait")  # returns once the row finished
    assert box.get("waited") is not None or not live.engine._running
    live.resume()
    runner.join(120)
    assert box["waited"]["finish_reason"] == "length" and len(box["waited"]["token_ids"]) == 60


def test_a_caller_that_hangs_up_frees_its_row(live):
    with pytest.raises(requests.Timeout):
        generate(live, [1, 2, 3], max_tokens=4000, ignore_eos=True, timeout=0.5)
    _wait(lambda: not live.engine._running, "the abandoned row to end", timeout=60)


def test_routes_answer_in_the_service_error_shape(live):
    auth = {"Authorization": f"Bearer {live.api_key}"}
    assert requests.get(f"{live.url}/health", timeout=10).json() == {"status": "ok"}
    for method, path in (("GET", "/v1/models"), ("POST", "/pause"), ("GET", "/nowhere")):
        resp = requests.request(method, f"{live.url}{path}", timeout=10)
        assert resp.status_code == 401 and resp.json()["error"]["message"] == "missing or wrong bearer token"
    assert requests.get(f"{live.url}/nowhere", headers=auth, timeout=10).json()["error"]["message"] == \
        "no route /nowhere"
    assert requests.get(f"{live.url}/pause", headers=auth, timeout=10).status_code == 405
    listed = requests.get(f"{live.url}/v1/models", headers=auth, timeout=10).json()["data"][0]
    assert listed["id"] == live.name and listed["max_model_len"] == live.max_model_len
    bad = requests.post(f"{live.url}/pause?mode=later", headers=auth, timeout=10)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "mode"
    assert requests.post(f"{live.url}/pause?mode=keep", headers=auth, timeout=10).json() == {"status": "paused"}
    assert requests.get(f"{live.url}/is_paused", headers=auth, timeout=10).json() == {"is_paused": True}
    named = requests.post(f"{live.url}/update_weight_version", json={"new_version": "v9"}, headers=auth, timeout=10)
    assert named.json() == {"success": True, "new_version": "v9"}
    refused = requests.post(f"{live.url}/update_weight_version", json={}, headers=auth, timeout=10)
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "new_version"
    assert requests.post(f"{live.url}/resume", headers=auth, timeout=10).json() == {"status": "resumed"}
    assert requests.get(f"{live.url}/weight_info", headers=auth, timeout=10).json() == {"weight_version": "v9"}
    not_json = requests.post(f"{live.url}/inference/v1/generate", data=b"{nope", headers=auth, timeout=10)
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request"
    nan = requests.post(f"{live.url}/v1/completions", headers=auth, timeout=10,
                        data=b'{"prompt": [1, 2], "temperature": NaN}')
    assert nan.status_code == 400 and nan.json()["error"]["field"] == "temperature"
    too_long = generate(live, [1] * live.max_model_len)
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
