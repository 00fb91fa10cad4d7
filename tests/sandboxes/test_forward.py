"""A task's sidecar beside the agent's sandbox on a real host with real bwrap sandboxes: a
sandbox kept by another shares its lifetime (its lease held while the keeper lives, closed with
it), and a forward makes the sidecar's port answer at 127.0.0.1 in the keeper's namespace, which
gains no other way out; only sandboxes of one job reach each other."""
from __future__ import annotations

import time

import pytest

from prorl_celery.errors import PolicyDenied, SandboxGone
from prorl_celery.http import request as http_request
from tests.sandboxes.conftest import needs_bwrap
from tests.sandboxes.test_host import create, entry_of

pytestmark = [pytest.mark.harbor, needs_bwrap()]
PORT = 18765
SERVE = (f"mkdir -p /tmp/www && echo sidecar-says-hi > /tmp/www/index.html && "
         f"(setsid python3 -m http.server {PORT} --bind 127.0.0.1 --directory /tmp/www </dev/null >/dev/null 2>&1 &) && "
         f"for i in $(seq 50); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {PORT}))' "
         "2>/dev/null && break; sleep 0.1; done")
FETCH = (f"python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:{PORT}/\", "
         "timeout=5).read().decode().strip())'")


def test_a_kept_sandbox_is_reached_through_its_forward_and_dies_with_its_keeper(start_host):
    host = start_host(runtime="bwrap", lease_s=2)
    agent = create(host, "job-side")
    sidecar = create(host, "job-side", keeper=agent.handle.sandbox_id, spec={"network": True})
    assert entry_of(host, sidecar).keeper == agent.handle.sandbox_id
    sidecar.exec(SERVE, timeout=30)
    assert "sidecar-says-hi" not in agent.exec(FETCH, timeout=30).output  # two namespaces: nothing yet
    assert agent.forward(sidecar.handle.sandbox_id, [PORT]) == [PORT]
    assert agent.exec(FETCH, timeout=30).output.strip() == "sidecar-says-hi"
    devices = agent.exec("tail -n +3 /proc/net/dev | cut -d: -f1; tail -n +2 /proc/net/route", timeout=30).output
    assert devices.split() == ["lo"]  # the agent's namespace: lo, no route out (the sidecar's tap0 is its own)
    assert "tap0" in sidecar.exec("cat /proc/net/dev").output
    for _ in range(3):  # past the sidecar's own lease: held while its keeper lives
        time.sleep(1.5)
        agent.exec("true")
    assert sidecar.exec("echo alive").output == "alive\n"
    agent.close()
    with pytest.raises(SandboxGone):
        sidecar.exec("true")


def test_only_sandboxes_of_one_job_keep_or_reach_each_other(start_host):
    host = start_host(runtime="bwrap")
    agent, stranger = create(host, "job-a"), create(host, "job-b")
    with pytest.raises(PolicyDenied):
        agent.forward(stranger.handle.sandbox_id, [PORT])
    answer = http_request("POST", f"{host.address}/sandboxes", headers={"Authorization": f"Bearer {host.token}"},
                          data=f'{{"job_id": "job-b", "keeper": "{agent.handle.sandbox_id}"}}', timeout=30)
    assert answer.status_code == 403 and "another job" in answer.text
