"""The API checks an instance without importing the handlers (tasks/handlers/instances.py): a
fresh API process answers bad instances with the 400 naming the field over real HTTP, and has
loaded no handler module afterwards; the registry's checks refuse what the handlers' own do."""
from __future__ import annotations

import os

import pytest
import requests

from prorl_celery.errors import ProrlError
from tasks.handlers import HANDLERS, get_handler, instance_check
from tests.flask_api.api_process import api_process

SWE = {"data_source": "swe", "instance_id": "x", "repo": "o/r", "problem_statement": "p",
       "base_commit": "0" * 40, "test_patch": "", "FAIL_TO_PASS": "[]", "PASS_TO_PASS": "[]"}
BAD = [  # (instance, the status and field of its refusal: 400 malformed, 403 policy)
    ({**SWE, "base_commit": "HEAD"}, 400, "instance.base_commit"),
    ({**SWE, "data_source": "swebench", "FAIL_TO_PASS": "[not json"}, 400, "instance.FAIL_TO_PASS"),
    ({**SWE, "repo_source": "http://example.com/o/r"}, 403, "instance.repo_source"),
    ({**SWE, "image": "/etc"}, 403, "instance.image"),
    ({"data_source": "gsm8k", "problem": "1+1", "sandbox": {"image": "/etc"}}, 403, "instance.sandbox.image"),
    ({"data_source": "shell", "commands": ["true"], "sandbox": {"env": {"LD_PRELOAD": "/x.so"}}},
     400, "instance.sandbox.env"),
    ({"data_source": "no-such-domain"}, 400, "instance.data_source"),
    ({"data_source": "echo", "text": " "}, 400, "instance.text"),
    ({"data_source": "echo", "text": "12345", "tools": "bash"}, 400, "instance.tools"),
]


def _post(url: str, instance: dict) -> requests.Response:
    return requests.post(f"{url}/jobs", json={"instance": instance}, timeout=30,
                         headers={"Authorization": f"Bearer {os.environ['PRORL_API_TOKEN']}"})


def _refusal(response: requests.Response) -> tuple[int, str]:
    error = response.json()["error"]
    assert error["message"] and error["type"] in ("invalid_request", "policy_denied"), response.text
    return response.status_code, error["field"]


def test_a_fresh_api_refuses_bad_instances_without_importing_a_handler(redis_url):
    with api_process() as api:
        assert [_refusal(_post(api.url, instance)) for instance, *_ in BAD] == [tuple(why) for _, *why in BAD]
        loaded = api.loaded_modules()
    assert "tasks.handlers.instances" in loaded  # the checks ran, from the light module
    assert set(loaded) <= {"tasks.handlers", "tasks.handlers.base", "tasks.handlers.check",
                           "tasks.handlers.instances", "tasks.swe", "tasks.swe.test_log"}, loaded


@pytest.mark.parametrize("instance,status,field", BAD)
def test_the_service_api_refuses_the_same_instances(api, instance, status, field):
    assert _refusal(requests.post(f"{api}/jobs", json={"instance": instance}, timeout=30)) == (status, field)


def _verdict(check, instance: dict) -> tuple[str, str | None] | None:
    try:
        check(instance)
    except ProrlError as exc:
        return type(exc).__name__, getattr(exc, "field", None)
    return None


@pytest.mark.unit
@pytest.mark.parametrize("name", [*HANDLERS.known(), "tests.handlers_for_tests:UserHandler"])
def test_the_registered_check_refuses_what_the_handler_refuses(name):
    probes = [instance for instance, *_ in BAD[:-1]] + [SWE, {"commands": []}]
    handler = get_handler(name)
    for probe in probes:
        assert _verdict(instance_check(name), probe) == _verdict(handler.check_instance, probe), (name, probe)
