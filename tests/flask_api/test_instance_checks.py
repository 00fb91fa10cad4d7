"""The API checks an instance without importing the handlers (tasks/handlers/instances.py): a
fresh API process answers bad instances with the 400 naming the field over real HTTP, and has
loaded no handler module afterwards; the registry's checks refuse what the handlers' own do."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from prorl_celery.errors import ProrlError
from tasks.handlers import HANDLERS, get_handler, instance_check

ROOT = Path(__file__).resolve().parents[2]
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
]
# An API process serving on a free port: prints the port, serves until a line on stdin, then
# prints the modules of tasks.handlers and tasks.verify it has loaded.
SERVE = """
import json, logging, sys, threading
from werkzeug.serving import make_server
from flask_api import create_app
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = make_server("127.0.0.1", 0, create_app(), threaded=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(server.server_port, flush=True)
sys.stdin.readline()
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("tasks.handlers", "tasks.verify")))))
"""


def _post(url: str, instance: dict) -> requests.Response:
    return requests.post(f"{url}/jobs", json={"instance": instance}, timeout=30,
                         headers={"Authorization": f"Bearer {os.environ['PRORL_API_TOKEN']}"})


def _refusal(response: requests.Response) -> tuple[int, str]:
    error = response.json()["error"]
    assert error["message"] and error["type"] in ("invalid_request", "policy_denied"), response.text
    return response.status_code, error["field"]


def test_a_fresh_api_refuses_bad_instances_without_importing_a_handler(redis_url):
    child = subprocess.Popen([sys.executable, "-c", SERVE], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{int(child.stdout.readline())}"
        assert [_refusal(_post(url, instance)) for instance, *_ in BAD] == [tuple(why) for _, *why in BAD]
        child.stdin.write("report\n")
        child.stdin.flush()
        loaded = json.loads(child.stdout.readline())
    finally:
        child.kill()
        child.wait(10)
    assert "tasks.handlers.instances" in loaded  # the checks ran, from the light module
    assert set(loaded) <= {"tasks.handlers", "tasks.handlers.base", "tasks.handlers.check",
                           "tasks.handlers.instances", "tasks.verify", "tasks.verify.test_log"}, loaded


@pytest.mark.parametrize("instance,status,field", BAD)
def test_the_service_api_refuses_the_same_instances(api, instance, status, field):
    assert _refusal(requests.post(f"{api}/jobs", json={"instance": instance}, timeout=30)) == (status, field)


def _verdict(check, instance: dict) -> tuple[str, str | None] | None:
    try:
        check(instance)
    except ProrlError as exc:
        return type(exc).__name__, getattr(exc, "field", None)
    return None


@pytest.mark.parametrize("name", [*HANDLERS.known(), "tests.handlers_for_tests:UserHandler"])
def test_the_registered_check_refuses_what_the_handler_refuses(name):
    probes = [instance for instance, *_ in BAD[:-1]] + [SWE, {"commands": []}]
    handler = get_handler(name)
    for probe in probes:
        assert _verdict(instance_check(name), probe) == _verdict(handler.check_instance, probe), (name, probe)
