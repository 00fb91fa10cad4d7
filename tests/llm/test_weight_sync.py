"""Weight updates under turns in flight: the fake server's pause with the real servers' semantics
(vLLM's ``/pause?mode=keep|wait|abort``, SGLang's ``/pause_generation``), and the service's
``POST /llm_servers/pause`` / ``resume`` over real HTTP with the pool continuing turns."""
from __future__ import annotations

import threading
import time

import pytest
import requests

from prorl_celery.llm import LLMRequest, SamplingParams
from prorl_celery.llm.models import Protocol
from tests.llm.conftest import eventually

PROMPT = [1, 2, 3, 4]


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def _generate(url: str, n: int) -> dict:
    return requests.post(f"{url}/inference/v1/generate", json={
        "token_ids": PROMPT, "sampling_params": {"max_tokens": n, "ignore_eos": True, "logprobs": 0}}, timeout=60).json()


def _tokens(proc) -> float:
    return proc.stats()["tokens"]


def test_keep_freezes_turns_in_place_and_they_go_on_with_the_new_version(fake_llms):
    (proc,) = fake_llms(1, latency="step_s=0.02,capacity=8")
    thread, box = _in_thread(lambda: _generate(proc.url, 60))
    eventually(lambda: _tokens(proc) > 5, 10, "tokens generated")
    assert requests.post(f"{proc.url}/pause", params={"mode": "keep"}, timeout=10).json() == {"status": "paused"}
    assert requests.get(f"{proc.url}/is_paused", timeout=5).json() == {"is_paused": True}
    frozen = _tokens(proc)
    late, late_box = _in_thread(lambda: _generate(proc.url, 5))  # arrives while paused: queued, not refused
    time.sleep(0.5)
    assert _tokens(proc) == frozen and thread.is_alive() and late.is_alive()
    assert requests.post(f"{proc.url}/update_weight_version", json={"new_version": "v2"}, timeout=5).json() \
        == {"success": True, "new_version": "v2"}
    assert requests.post(f"{proc.url}/resume", timeout=5).json() == {"status": "resumed"}
    thread.join(30)
    late.join(30)
    choice = box["out"]["choices"][0]
    spans = choice["weight_versions"]
    assert len(choice["token_ids"]) == 60 and choice["finish_reason"] != "abort"
    assert [s["version"] for s in spans] == ["default", "v2"] and spans[0]["start"] == 0
    assert 0 < spans[0]["end"] == spans[1]["start"] < 60 and spans[1]["end"] == 60
    assert late_box["out"]["choices"][0]["weight_versions"] == [{"version": "v2", "start": 0, "end": 5}]
    pauses = proc.stats()["pauses"]
    assert pauses[0]["mode"] == "keep" and pauses[0]["frozen"] == 1 and pauses[0]["server_s"] < 0.1


def test_abort_answers_the_tokens_so_far_and_wait_lets_them_finish(fake_llms):
    (proc,) = fake_llms(1, latency="step_s=0.02,capacity=8")
    completion = lambda: requests.post(f"{proc.url}/v1/completions", json={  # noqa: E731
        "prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "return_token_ids": True, "logprobs": 0}, timeout=60).json()
    thread, box = _in_thread(completion)
    eventually(lambda: _tokens(proc) > 5, 10, "tokens generated")
    requests.post(f"{proc.url}/pause", params={"mode": "abort"}, timeout=10).raise_for_status()
    thread.join(10)
    choice = box["out"]["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 60
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    requests.post(f"{proc.url}/resume", timeout=5).raise_for_status()
    sglang = lambda: requests.post(f"{proc.url}/generate", json={  # noqa: E731
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}, "return_logprob": True},
        timeout=60).json()
    base = _tokens(proc)
    thread, box = _in_thread(sglang)
    eventually(lambda: _tokens(proc) > base + 5, 10, "SGLang tokens generated")
    assert requests.post(f"{proc.url}/pause_generation", json={"mode": "abort"}, timeout=10).json()["status"] == "ok"
    thread.join(10)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(box["out"]["output_ids"]) < 60
    requests.post(f"{proc.url}/continue_generation", timeout=5).raise_for_status()
    thread, box = _in_thread(lambda: _generate(proc.url, 30))
    eventually(lambda: proc.stats()["running"] == 1, 10, "a request running")
    requests.post(f"{proc.url}/pause", params={"mode": "wait"}, timeout=30).raise_for_status()
    assert proc.stats()["running"] == 0  # it returned only once the request in flight finished
    thread.join(10)
    assert len(box["out"]["choices"][0]["token_ids"]) == 30
    requests.post(f"{proc.url}/resume", timeout=5).raise_for_status()
    bad = requests.post(f"{proc.url}/pause", params={"mode": "sideways"}, timeout=5)
    assert bad.status_code == 422
    (llamacpp,) = fake_llms(1, extra=["--flavor", "llama.cpp"])
    assert requests.post(f"{llamacpp.url}/pause", timeout=5).status_code == 404  # llama.cpp has no pause


@pytest.fixture
def llm_api(api, pool):
    return api


def _register(api: str, url: str, **spec) -> str:
    body = {"address": url, "protocol": "generate", "dialect": "fake", "weight_version": "v1", **spec}
    resp = requests.post(f"{api}/llm_servers", json=body, timeout=10)
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


LONG = LLMRequest(messages=[{"role": "user", "content": "q"}], sampling=SamplingParams(max_tokens=150, ignore_eos=True))


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_pause_over_http_loses_no_token_and_versions_every_one(llm_api, pool, fake_llms, mode):
    """A turn in flight across ``POST /llm_servers/pause`` and ``resume {"weight_version"}``: the
    pause returns at once (the server's own pause), the turn is neither lost nor started again,
    its ids are those of an undisturbed turn, and its segments say which came from v1 and v2."""
    api = llm_api
    (proc,) = fake_llms(1, latency="step_s=0.02,capacity=8")
    bid = _register(api, proc.url, pause_api="vllm")
    undisturbed = pool.generate("ref", LONG)
    since = proc.received()[-1]["id"]
    thread, box = _in_thread(lambda: pool.generate("job", LONG))
    eventually(lambda: _tokens(proc) > undisturbed.response_ids.__len__() + 10, 10, "tokens of the second turn")
    paused = requests.post(f"{api}/llm_servers/pause", json={"mode": mode, "backends": [bid]}, timeout=30).json()
    assert paused["safe"] is True and paused["modes"] == {bid: mode} and paused["errors"] == {}
    assert set(paused["server_s"]) == {bid} and paused["pause_s"] >= paused["server_s"][bid]
    assert pool.registry.get(bid).status.value == "draining"
    time.sleep(0.3)
    assert thread.is_alive()  # safe to write without waiting for the turn: held (frozen, or waiting for resume)
    resumed = requests.post(f"{api}/llm_servers/resume", json={"weight_version": "v2", "backends": [bid]},
                            timeout=10).json()
    assert resumed["backends"][0]["weight_version"] == "v2" and resumed["backends"][0]["status"] == "active"
    thread.join(30)
    turn = box["out"]
    assert turn.response_ids == undisturbed.response_ids and len(turn.logprobs) == len(turn.response_ids)
    versions = [(s.version, s.start, s.end) for s in turn.weight_segments]
    assert [v for v, _, _ in versions] == ["v1", "v2"] and versions[0][1] == 0
    assert versions[0][2] == versions[1][1] and versions[1][2] == len(turn.response_ids)
    assert turn.weight_version == "v1+v2" and turn.continued == (1 if mode == "abort" else 0)
    sent = [r for r in proc.received(since) if r["endpoint"] == "generate"]
    assert all(r["status"] == "ok" for r in sent)  # nothing dropped by a disconnect
    if mode == "abort":  # the second request went on from the first one's ids: nothing thrown away
        first, second = sent
        assert first["finish_reason"] == "abort"
        assert second["prompt_ids"] == first["prompt_ids"] + first["response_ids"]
        assert first["response_ids"] + second["response_ids"] == turn.response_ids
    else:
        assert len(sent) == 1


def test_backends_fall_back_to_what_they_can_and_bad_bodies_name_the_field(llm_api, pool, fake_llms):
    api = llm_api
    proc, other = fake_llms(2, latency="step_s=0.02,capacity=8")
    plain = _register(api, proc.url)  # no pause API declared: drained
    chat = requests.post(f"{api}/llm_servers", json={"address": other.url, "pause_api": "vllm"}, timeout=10).json()["id"]
    thread, box = _in_thread(lambda: pool.generate("job", LONG.model_copy(update={"protocol": Protocol.GENERATE})))
    eventually(lambda: pool.registry.get(plain).in_flight == 1, 5, "a request in flight")
    paused = requests.post(f"{api}/llm_servers/pause", json={"mode": "keep"}, timeout=30).json()
    # no pause API: drained; chat (no per-token versions to continue from): drained too
    assert paused["modes"] == {plain: "drain", chat: "drain"} and paused["safe"] is True
    assert paused["in_flight"] == {plain: 0, chat: 0}
    thread.join(10)  # its lease is released before the call returns: the thread may still be ending
    assert not thread.is_alive()
    assert box["out"].weight_segments[0].version == "v1"
    requests.post(f"{api}/llm_servers/resume", json={"weight_version": "v2"}, timeout=10).raise_for_status()
    for body, field in [({"mode": "sideways"}, "mode"), ({"wait": -1}, "wait"), ({"backends": "x"}, "backends"),
                        ({"extra": 1}, "extra")]:
        resp = requests.post(f"{api}/llm_servers/pause", json=body, timeout=10)
        assert resp.status_code == 400 and resp.json()["error"]["field"] == field, (body, resp.text)
    resp = requests.post(f"{api}/llm_servers/resume", json={"weight_version": ""}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "weight_version"
    assert requests.post(f"{api}/llm_servers/pause", json={"backends": ["llm-nope"]}, timeout=10).status_code == 404
    resp = requests.post(f"{api}/jobs/ack", json={"job_ids": []}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "job_ids"


def test_a_pause_no_resume_ends_expires_and_the_turns_go_on_with_the_old_version(llm_api, pool, fake_llms):
    """A trainer that pauses and never resumes (it died) does not hold every rollout forever: past
    ``max_pause_s`` the turn waiting on the backend resumes it on the version it had, the backend
    says so (``pause_expired_at``), and the operator's ``PRORL_LLM_MAX_PAUSE_S`` caps what a
    request may ask."""
    api = llm_api
    (proc,) = fake_llms(1, latency="step_s=0.02,capacity=8")
    bid = _register(api, proc.url, pause_api="vllm")
    capped = requests.post(f"{api}/llm_servers/pause", json={"backends": [bid], "max_pause_s": 1e9}, timeout=30)
    assert capped.status_code == 200, capped.text
    assert capped.json()["max_pause_s"] == 900  # the operator's default: a request only shortens it
    requests.post(f"{api}/llm_servers/resume", json={"backends": [bid]}, timeout=10).raise_for_status()
    thread, box = _in_thread(lambda: pool.generate("job", LONG))
    eventually(lambda: _tokens(proc) > 10, 10, "tokens of the turn")
    paused = requests.post(f"{api}/llm_servers/pause", json={"mode": "keep", "backends": [bid], "max_pause_s": 1.5},
                           timeout=30).json()
    assert paused["max_pause_s"] == 1.5 and paused["expires_at"] > time.time()
    time.sleep(0.5)
    held = pool.registry.get(bid)
    assert thread.is_alive() and held.status.value == "draining" and held.paused_until == paused["expires_at"]
    thread.join(30)
    assert not thread.is_alive(), "the pause never expired"
    turn = box["out"]
    assert [s.version for s in turn.weight_segments] == ["v1"] and len(turn.response_ids) == 150
    backend = pool.registry.get(bid)
    assert backend.status.value == "active" and backend.weight_version == "v1" and backend.paused_until is None
    assert paused["expires_at"] <= backend.pause_expired_at < paused["expires_at"] + 5
    assert requests.get(f"{proc.url}/is_paused", timeout=5).json() == {"is_paused": False}
    listed = requests.get(f"{api}/llm_servers", timeout=10).json()["backends"]
    assert [b["pause_expired_at"] for b in listed if b["id"] == bid] == [backend.pause_expired_at]
    for bad in (0, -1, "soon"):
        resp = requests.post(f"{api}/llm_servers/pause", json={"backends": [bid], "max_pause_s": bad}, timeout=10)
        assert resp.status_code == 400 and resp.json()["error"]["field"] == "max_pause_s"


@pytest.mark.unit
def test_an_expired_pause_is_resumed_once_and_a_resume_cancels_the_expiry(pool):
    """:func:`expire_pauses` on the registry alone (a backend with no pause API: drained, so no
    server is called): past ``paused_until`` it resumes the backend once however many turns look,
    on the version it had; a pause that was resumed in time never expires."""
    from prorl_celery.llm import BackendSpec
    from prorl_celery.llm.control import expire_pauses, pause, resume

    registry = pool.registry
    bid, _ = registry.add(BackendSpec(address="http://10.9.0.1:8000", protocol="generate", dialect="fake",
                                      weight_version="v1"))
    bid = bid.id
    paused = pause(registry, [bid], "keep", 0, max_pause_s=30)
    assert paused["modes"] == {bid: "drain"} and paused["max_pause_s"] == 30
    assert expire_pauses(registry, paused["expires_at"] - 1) == []  # not yet
    assert expire_pauses(registry, paused["expires_at"] + 1) == [bid]
    assert expire_pauses(registry, paused["expires_at"] + 2) == []  # once
    backend = registry.get(bid)
    assert (backend.status.value, backend.weight_version, backend.paused_until) == ("active", "v1", None)
    assert backend.pause_expired_at == paused["expires_at"] + 1
    again = pause(registry, [bid], "keep", 0, max_pause_s=30)
    assert registry.get(bid).pause_expired_at is None  # the next pause starts clean
    resume(registry, [bid], "v2")
    assert expire_pauses(registry, again["expires_at"] + 1) == []
    assert registry.get(bid).weight_version == "v2"
