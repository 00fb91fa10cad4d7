"""Cheap hostile requests against a fresh API process: a dotted path to a module that runs a
program when imported, a body nested a thousand deep, a client that sends no token."""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import requests

from tests.flask_api.api_process import api_process

ROOT = Path(__file__).resolve().parents[2]
GYM = json.loads((ROOT / "tests/fixtures/nemo_gym/prorl_agent_requests.json").read_text())
PROBES = ("sandboxes.host", "tests.import_probe")


def _post(url: str, body: object | str) -> requests.Response:
    data = body if isinstance(body, str) else json.dumps(body)
    return requests.post(f"{url}/jobs", data=data, timeout=30, headers={
        "Authorization": f"Bearer {os.environ['PRORL_API_TOKEN']}", "Content-Type": "application/json"})


def test_a_dotted_path_is_refused_from_its_source_before_any_import(redis_url, tmp_path):
    mark = tmp_path / "imported"
    with api_process({**os.environ, "PRORL_TEST_IMPORT_MARK": str(mark)}) as api:
        for source in ("sandboxes.host.__main__:SandboxHost",  # a CLI at import: SystemExit
                       "tests.import_probe.__main__:ProbeHandler",  # a handler's shape, in a __main__
                       "tests.import_probe.not_a_handler:Thing"):  # no init, run, eval in its source
            resp = _post(api.url, {"instance": {"data_source": source}})
            assert resp.status_code == 400, (source, resp.text)
            assert resp.json()["error"]["field"] == "instance.data_source"
        assert api.loaded_modules(*PROBES) == [] and not mark.exists()
        # the control: a handler whose module marks its import is imported (its check refuses the job)
        resp = _post(api.url, {"instance": {"data_source": "tests.import_probe.handler:MarkedHandler"}})
        assert resp.status_code == 400 and resp.json()["error"]["field"] == "instance", resp.text
        assert "tests.import_probe.handler" in api.loaded_modules(*PROBES)
    assert mark.read_text().split() == ["tests.import_probe.handler"]


@pytest.fixture(scope="module")
def plain_api(redis_url):
    """One fresh API process for the tests below, which only send it requests."""
    with api_process() as api:
        yield api


def test_a_deeply_nested_body_is_400_naming_the_body(plain_api):
    for depth in (150, 990, 100_000):
        nested = '{"instance": {"data_source": "shell", "x": ' + "[" * depth + "]" * depth + "}}"
        resp = _post(plain_api.url, nested)
        assert resp.status_code == 400, (depth, resp.text)
        assert resp.json()["error"]["field"] == "body", resp.text
    fine = '{"instance": {"data_source": "nope", "x": ' + "[" * 50 + "]" * 50 + "}}"
    assert _post(plain_api.url, fine).json()["error"]["field"] == "instance.data_source"  # parsed, then judged


def test_nemo_gym_unpatched_calls_are_told_what_to_do(plain_api):
    """Gym's client sends no token: every call is 401, and the answer names the fix."""
    for call in GYM["requests"]:
        data = json.dumps(call["json"]).encode() if call["json"] is not None else None
        sent = urllib.request.Request(f"{plain_api.url}{call['path']}", data=data, method=call["method"],
                                      headers=GYM["headers"])
        try:
            urllib.request.urlopen(sent, timeout=30)
            raise AssertionError(f"{call['name']} was served without a token")
        except urllib.error.HTTPError as refused:
            error = json.loads(refused.read())["error"]
            assert refused.code == 401 and error["type"] == "unauthorized", call["name"]
            assert "patch_prorl_agent()" in error["message"] and "Bearer" in error["message"]
