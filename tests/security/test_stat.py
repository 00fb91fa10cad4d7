"""``stat`` cannot be used to look outside a sandbox's workspace: the sandbox plants symlinks
(to the host's root, to a file, in a parent directory) and asks the host, over HTTP as a stage
does and with raw requests, about what lies behind them."""
from __future__ import annotations

import pytest
import requests

from tests.sandboxes.conftest import needs_bwrap, sandbox_redis, sandbox_root, start_host  # noqa: F401
from tests.sandboxes.test_host import create

pytestmark = needs_bwrap()

PLANT = ("cd ~ && ln -s / root && ln -s /etc/shadow shadow && ln -s .. up && mkdir -p d "
         "&& ln -s /etc d/etc && ln -s ../../.. d/out")


ESCAPES = ("root/etc", "root/etc/shadow", "up/x", "d/etc/passwd", "d/out/etc", "../..", "/etc/passwd",
           "/workspace/../etc", "shadow/x", "d/../../etc")


def test_stat_never_leaves_the_workspace(start_host):
    host = start_host(runtime="bwrap")
    box = create(host, "stat-escape")
    assert box.exec(PLANT).exit_code == 0
    for path in ESCAPES:
        with pytest.raises(PermissionError):
            box.stat(path)
    # the links themselves are reported as links, not as what they point at
    assert {box.stat(name).kind for name in ("root", "shadow", "up", "d/etc", "d/out")} == {"link"}
    assert box.stat("shadow").size == len("/etc/shadow")  # its own length, not the host file's


def test_stat_over_raw_http_is_the_same_refusal(start_host):
    host = start_host(runtime="bwrap")
    box = create(host, "stat-escape")
    box.exec(PLANT)
    headers = {"Authorization": f"Bearer {host.token}"}
    url = f"{host.address}/sandboxes/{box.handle.sandbox_id}/stat"
    for body in ({"path": "root/etc"}, {"path": "../etc"}, {"path": "/etc"}):
        reply = requests.post(url, json=body, headers=headers, timeout=30)
        assert reply.status_code == 403 and reply.json()["error"]["type"] == "permission_denied", body
    # arguments the model does not take are refused, not passed on to the runtime
    reply = requests.post(url, json={"path": "d", "follow_symlinks": True}, headers=headers, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request"
    assert requests.post(url, json={"path": "d"}, timeout=30).status_code == 401  # no token
