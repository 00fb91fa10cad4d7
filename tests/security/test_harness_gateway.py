"""A harness session's sandbox reaches its own gateway and nothing else (issue 26, part 2).

Attacked for real through the whole service, from inside bwrap sandboxes running a ``command``
harness: its gateway answers through the forwarder on the sandbox's own loopback; the test
stack's Redis (where every session's records are), the API, the fake LLM, listeners this test
opens on the host's loopback and addresses, and outside addresses do not; the gateways' socket
directory cannot be listed; the session's own socket refuses a missing or wrong credential; and
another live session's gateway, even named to it, refuses this session's credential."""
from __future__ import annotations

import json
import os
import time
from urllib.parse import urlsplit

import pytest

from config.settings import get_settings
from tests.conftest import submit, wait, wait_until
from tests.harnesses.test_command import agent_command
from tests.harnesses.test_mini_swe_agent import oracle_llm  # noqa: F401 - the oracle backend fixture
from tests.sandboxes.conftest import needs_bwrap
from tests.security.test_network import listeners, probe_command, verdicts  # noqa: F401 - fixture

pytestmark = [needs_bwrap()]

# Inside the sandbox: its own socket without and with a wrong credential, the directory, and
# (argv[1], when given) another session's socket with this session's credential.
SOCKETS = r'''
import json, os, socket, sys
def ask(path, key):
    s = socket.socket(socket.AF_UNIX); s.settimeout(5)
    try:
        s.connect(path)
    except OSError as exc:
        return type(exc).__name__
    head = "GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    s.sendall((head + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n").encode())
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data.split(b" ", 2)[1].decode()
out = {}
d = sys.argv[1]
try:
    out["listing"] = os.listdir(d)
except OSError as exc:
    out["listing"] = type(exc).__name__
own = os.environ["PRORL_GATEWAY_SOCKET"]
out["own_none"] = ask(own, "")
out["own_wrong"] = ask(own, "guess")
out["own_right"] = ask(own, os.environ["OPENAI_API_KEY"])
if len(sys.argv) > 2:
    out["other"] = ask(sys.argv[2], os.environ["OPENAI_API_KEY"])
print("SOCKETS", json.dumps(out))
'''


def _job(api, command: str) -> str:
    return submit(api, {"data_source": "math", "problem": "What is 1+1?", "answer": "2",
                        "agent": {"harness": "command", "command": command, "wall_s": 60}})


def _sockets(output: str) -> dict:
    line = next(x for x in output.splitlines() if x.startswith("SOCKETS "))
    return json.loads(line.split(" ", 1)[1])


def test_a_harness_sandbox_reaches_its_gateway_and_nothing_else(api, stack, redis_url, oracle_llm, listeners):
    targets, secret = listeners
    services = [f"127.0.0.1:{urlsplit(u).port}" for u in (redis_url, api, oracle_llm)]
    outside = ["10.0.2.2:80", "192.0.2.1:80", "1.1.1.1:53"]
    directory = get_settings().gateway_socket_dir
    command = (f"{agent_command(1)}\n{probe_command(*targets, *services, *outside)}\n"
               f"python3 -I - {directory} <<'PY'\n{SOCKETS}\nPY")
    view = wait(api, _job(api, command), timeout=120)
    result = view["result"]
    output = result["harness"]["output"]
    assert view["status"] == "completed" and result["turns"] == 1, output  # its gateway answered
    seen = verdicts(output)
    assert all(seen[t] == "BLOCKED" for t in [*targets, *services, *outside]), output
    assert secret not in output
    sockets = _sockets(output)
    assert sockets["listing"] == "PermissionError"
    assert sockets["own_none"] == sockets["own_wrong"] == "401" and sockets["own_right"] == "200"


def test_one_session_cannot_use_anothers_gateway(api, stack, oracle_llm):
    directory = get_settings().gateway_socket_dir
    before = set(os.listdir(directory))
    first = _job(api, "sleep 30")  # holds its session (and socket) open
    theirs = wait_until(lambda: set(os.listdir(directory)) - before, 60, "the first session's socket")
    assert len(theirs) == 1
    other = os.path.join(directory, theirs.pop())
    view = wait(api, _job(api, f"python3 -I - {directory} {other} <<'PY'\n{SOCKETS}\nPY"), timeout=120)
    sockets = _sockets(view["result"]["harness"]["output"])
    assert sockets["own_right"] == "200" and sockets["other"] == "401", sockets
    import requests

    requests.delete(f"{api}/jobs/{first}", timeout=10)
    assert wait(api, first, timeout=60)["status"] == "cancelled"
    wait_until(lambda: not os.path.exists(other), 30, "the cancelled session's socket to go")
