"""The LLM backend endpoints over real HTTP against the running API."""
from __future__ import annotations

import threading
import time

import pytest
import requests

from prorl_celery.llm import LLMRequest, SamplingParams
from tests.llm.conftest import eventually


@pytest.fixture
def llm_api(api, pool):
    return api


def test_register_list_remove(llm_api):
    api = llm_api
    first = requests.post(f"{api}/llm_servers", json={"address": "http://10.1.0.1:8000/v1", "capacity": 16,
                                                      "protocol": "generate", "dialect": "fake",
                                                      "weight_version": "v1", "probe": False}, timeout=10)
    assert first.status_code == 201 and first.json()["created"] is True
    bid = first.json()["id"]
    again = requests.post(f"{api}/llm_servers", json={"address": "10.1.0.1:8000", "probe": False}, timeout=10)
    assert again.status_code == 200 and again.json()["id"] == bid and again.json()["created"] is False
    listed = requests.get(f"{api}/llm_servers", timeout=10).json()["backends"]
    assert len(listed) == 1
    row = listed[0]
    assert {k: row[k] for k in ("id", "status", "capacity", "protocol", "in_flight", "served", "failures",
                                 "weight_version")} == {
        "id": bid, "status": "active", "capacity": 16, "protocol": "generate", "in_flight": 0, "served": 0,
        "failures": 0, "weight_version": "v1"}
    assert requests.delete(f"{api}/llm_servers/{bid}", timeout=10).json() == {"removed": bid}
    gone = requests.delete(f"{api}/llm_servers/{bid}", timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found"
    assert requests.get(f"{api}/llm_servers", timeout=10).json()["backends"] == []


def test_reference_endpoints(llm_api):
    api = llm_api
    one = requests.post(f"{api}/add_llm_server", json={"address": "http://10.1.0.2:8000"}, timeout=10).json()
    same = requests.post(f"{api}/add_llm_server", json={"address": "http://10.1.0.2:8000/"}, timeout=10).json()
    requests.post(f"{api}/add_llm_server", json={"address": "http://10.1.0.3:8000"}, timeout=10)
    assert one["id"] == same["id"] and same["created"] is False
    assert len(requests.get(f"{api}/llm_servers", timeout=10).json()["backends"]) == 2
    cleared = requests.post(f"{api}/clear_llm_server", timeout=10)
    assert cleared.status_code == 200 and len(cleared.json()["removed"]) == 2
    assert requests.get(f"{api}/llm_servers", timeout=10).json()["backends"] == []


@pytest.mark.parametrize("path,body,field", [
    ("/llm_servers", {"capacity": 4}, "address"),
    ("/llm_servers", {"address": "http://h:1", "capacity": 0}, "capacity"),
    ("/llm_servers", {"address": "http://h:1", "protocol": "grpc"}, "protocol"),
    ("/llm_servers", {"address": "ftp://h:1"}, "address"),
    ("/llm_servers", {"address": "http://h:1", "bogus": 1}, "bogus"),
    ("/llm_servers/drain", {"wait": -1}, "wait"),
    ("/llm_servers/resume", {"ids": "all"}, "ids"),
    ("/add_llm_server", {}, "address"),
])
def test_bad_input_is_400_naming_the_field(llm_api, path, body, field):
    resp = requests.post(f"{llm_api}{path}", json=body, timeout=10)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request" and error["field"] == field and error["message"]


def test_drain_over_http_waits_for_in_flight_then_resume(llm_api, pool, fake_llms):
    api = llm_api
    (proc,) = fake_llms(1, latency="step_s=0.05,capacity=4")
    bid = requests.post(f"{api}/llm_servers", json={"address": proc.url, "weight_version": "v1"},
                        timeout=10).json()["id"]
    box = {}
    request = LLMRequest(messages=[{"role": "user", "content": "q"}],
                         sampling=SamplingParams(max_tokens=12, ignore_eos=True))
    worker = threading.Thread(target=lambda: box.setdefault("turn", pool.generate("h", request)))
    worker.start()
    eventually(lambda: pool.registry.get(bid).in_flight == 1, 5, "a request in flight")
    started = time.monotonic()
    drained = requests.post(f"{api}/llm_servers/drain", json={"ids": [bid], "wait": 10}, timeout=30).json()
    assert drained["drained"] is True and drained["in_flight"] == {bid: 0}
    assert time.monotonic() - started > 0.1 and drained["backends"][0]["status"] == "draining"
    worker.join(10)
    assert box["turn"].weight_version == "v1"  # the request in flight finished on the old weights
    waiting = threading.Thread(target=lambda: box.setdefault("next", pool.generate("h", request)))
    waiting.start()
    time.sleep(0.4)
    assert waiting.is_alive()
    resumed = requests.post(f"{api}/llm_servers/resume", json={"weight_version": "v2"}, timeout=10).json()
    assert resumed["resumed"] == [bid] and resumed["backends"][0]["status"] == "active"
    waiting.join(10)
    assert box["next"].weight_version == "v2"
    unknown = requests.post(f"{api}/llm_servers/drain", json={"ids": ["llm-nope"]}, timeout=10)
    assert unknown.status_code == 404


def test_metrics_show_backends(llm_api):
    bid = requests.post(f"{llm_api}/llm_servers", json={"address": "http://10.1.0.9:8000", "capacity": 7, "probe": False},
                        timeout=10).json()["id"]
    text = requests.get(f"{llm_api}/metrics", timeout=10).text
    assert f'prorl_llm_capacity{{address="http://10.1.0.9:8000",backend="{bid}"}} 7.0' in text
    assert f'prorl_llm_backend_status{{address="http://10.1.0.9:8000",backend="{bid}",status="active"}} 1.0' in text
