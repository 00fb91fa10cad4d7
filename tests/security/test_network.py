"""Row 1 of issue 10: a sandbox with ``"network": true`` has its own network.

Attacked for real from inside bwrap sandboxes on a real sandbox host (and once through the whole
service): the test stack's Redis, listeners this test opens on 127.0.0.1 and on the host's own
address, slirp's alias of the host (10.0.2.2) and the private ranges are unreachable, and the
secrets those listeners send never reach the output; ``/proc/net/tcp`` inside lists none of the
host's sockets; the sandbox cannot lift its policy. The other side is proved too: an "outside"
server, in a network namespace this test makes and routes from the host at a public-looking
documentation address (this machine has no internet), answers. No slirp4netns outlives its
sandbox: not after a close, a shell restart, or a kill -9 of the host.
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest
import requests

from prorl_celery.errors import SandboxError
from sandboxes.runtimes.limits import netns
from tests.conftest import submit, wait
from tests.sandboxes.conftest import (needs_bwrap, sandbox_redis, sandbox_root,  # noqa: F401
                                      start_host, wait_until)
from tests.sandboxes.test_host import create, entry_of

pytestmark = [needs_bwrap(), pytest.mark.skipif(os.geteuid() != 0 or netns.refusal() is not None,
                                                reason=f"needs root (ip netns) and slirp4netns, nft: "
                                                       f"{netns.refusal()}")]

SERVER = """
import socket, sys, threading
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
def serve(conn):
    with conn:
        conn.sendall(sys.argv[3].encode() + b"\\n")
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""

# Run inside the sandbox: connect to each target, say what came back.
PROBE = """
import socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=3) as conn:
            conn.sendall(b"PING\\r\\n")
            print(target, "OPEN", conn.recv(200))
    except OSError as exc:
        print(target, "BLOCKED", type(exc).__name__)
"""


def probe_command(*targets: str) -> str:
    return f"python3 -c '{PROBE}' {' '.join(targets)}"


def verdicts(output: str) -> dict[str, str]:
    return {line.split()[0]: line.split()[1] for line in output.splitlines() if len(line.split()) > 1}


@dataclass
class Outside:
    target: str
    secret: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def outside() -> Iterator[Outside]:
    """A server at 198.51.100.<n> in a network namespace of its own, routed from the host over a
    veth pair: what "the internet" is on this machine."""
    tag = os.getpid() % 200 + 20
    ns, veth = f"prorl-out-{os.getpid()}", f"po{os.getpid()}"
    public, link = f"198.51.100.{tag}", f"10.213.{tag}"
    secret = f"OUTSIDE-{secrets.token_hex(8)}"
    _ip("netns", "add", ns)
    server = None
    try:
        _ip("link", "add", f"{veth}h", "type", "veth", "peer", "name", f"{veth}n")
        _ip("link", "set", f"{veth}n", "netns", ns)
        _ip("addr", "add", f"{link}.1/30", "dev", f"{veth}h")
        _ip("link", "set", f"{veth}h", "up")
        for args in (("addr", "add", f"{link}.2/30", "dev", f"{veth}n"), ("link", "set", f"{veth}n", "up"),
                     ("link", "set", "lo", "up"), ("addr", "add", f"{public}/32", "dev", "lo"),
                     ("route", "add", "default", "via", f"{link}.1")):
            _ip("-n", ns, *args)
        _ip("route", "add", f"{public}/32", "via", f"{link}.2")
        server = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", SERVER, public,
                                   "8080", secret], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        with socket.create_connection((public, 8080), timeout=5) as conn:  # routed from the host
            assert conn.recv(100).decode().strip() == secret
        yield Outside(f"{public}:8080", secret)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "route", "del", f"{public}/32"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{veth}h"], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def listeners() -> Iterator[tuple[list[str], str]]:
    """TCP servers on the host's loopback and on each of its own addresses, each sending a secret
    to whoever connects: ``(["addr:port", ...], secret)``."""
    secret = f"HOST-SECRET-{secrets.token_hex(8)}"
    addresses = ["127.0.0.1"] + [net.split("/")[0] for net in netns.host_addresses()
                                 if not net.startswith("127.")]
    servers = [socket.create_server((address, 0)) for address in addresses]
    v6 = ["::1"] + host_addresses_v6()
    servers += [socket.create_server(("::", 0), family=socket.AF_INET6)] * len(v6)
    addresses += v6
    stop = threading.Event()

    def serve(server: socket.socket) -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(secret.encode())

    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in set(servers)]
    for thread in threads:
        thread.start()
    targets = [f"{a}:{s.getsockname()[1]}" for a, s in zip(addresses, servers)]
    for address, server in zip(addresses, servers):  # each answers from the host itself
        with socket.create_connection((address, server.getsockname()[1]), timeout=5) as conn:
            assert conn.recv(100).decode() == secret
    yield targets, secret
    stop.set()
    for server in set(servers):
        server.close()


def host_addresses_v6() -> list[str]:
    """The host's global IPv6 addresses (scope 00 in /proc/net/if_inet6)."""
    with open("/proc/net/if_inet6") as fh:
        rows = [line.split() for line in fh]
    return [str(ipaddress.IPv6Address(bytes.fromhex(row[0]))) for row in rows if row[3] == "00"
            and row[5] != "lo"]


def own_host(start_host, **kwargs):
    """A host whose id no concurrent test run shares (its cgroups and workspaces are keyed by it)."""
    return start_host(runtime="bwrap", host_id=f"net-{os.getpid()}-{secrets.token_hex(3)}", **kwargs)


def redis_port(url: str) -> int:
    return urlsplit(url).port


def host_targets(ports: list[int], listening: list[str]) -> list[str]:
    """Every way from a sandbox towards the host's services: loopback, slirp's host alias, the
    host's own addresses, a private range."""
    addresses = ["127.0.0.1", "10.0.2.2"] + [net.split("/")[0] for net in netns.host_addresses()
                                             if not net.startswith("127.")]
    return listening + [f"{a}:{p}" for p in ports for a in addresses] + [f"10.0.2.2:{listening[0].split(':')[1]}"]


def listening_ports(proc_net_tcp: str) -> set[int]:
    rows = [line.split() for line in proc_net_tcp.splitlines()[1:] if line.strip()]
    return {int(row[1].rsplit(":", 1)[1], 16) for row in rows if row[3] == "0A"}


def test_network_sandbox_reaches_the_outside_but_not_the_host(start_host, sandbox_redis, outside,
                                                              listeners):
    listening, secret = listeners
    host = own_host(start_host)
    box = create(host, "net", spec={"network": True})
    targets = host_targets([redis_port(sandbox_redis), int(host.address.rsplit(":", 1)[1])], listening)
    out = box.exec(probe_command(outside.target, *targets), timeout=60).output
    seen = verdicts(out)
    assert seen[outside.target] == "OPEN" and outside.secret in out, out  # the outside answers
    assert all(seen[target] == "BLOCKED" for target in targets), out
    assert secret not in out and "PONG" not in out and "NOAUTH" not in out
    # its own network: none of the host's sockets, no listener at all
    inside = box.exec("cat /proc/net/tcp /proc/net/tcp6").output
    host_ports = listening_ports(open("/proc/net/tcp").read())
    assert redis_port(sandbox_redis) in host_ports  # the probe of the listing itself works
    assert listening_ports(inside) == set(), inside
    # it cannot lift its policy or change its routes
    for attack in ("nft flush ruleset", "ip route add 192.0.2.0/24 dev tap0", "ip addr add 10.0.2.50/24 dev tap0",
                   "ip link set tap0 down"):
        assert box.exec(attack).exit_code != 0, attack
    again = box.exec(probe_command(outside.target, *targets), timeout=60).output
    assert verdicts(again)[outside.target] == "OPEN" and secret not in again
    assert all(verdicts(again)[t] == "BLOCKED" for t in targets), again
    info = entry_of(host, box).info
    assert info["network"].startswith("isolated") and info["net_pid"]


def test_names_resolve_through_the_sandboxs_own_resolver(start_host):
    try:
        expected = socket.gethostbyname("pypi.org")
    except OSError:
        pytest.skip("this host resolves no names itself")
    box = create(own_host(start_host), "dns", spec={"network": True})
    assert box.exec("cat /etc/resolv.conf").output.startswith("nameserver 10.0.2.3\n")
    assert expected in box.exec("getent hosts pypi.org").output


def test_without_network_nothing_is_reachable(start_host, outside):
    box = create(own_host(start_host), "no-net")
    out = box.exec(probe_command(outside.target)).output
    assert verdicts(out)[outside.target] == "BLOCKED" and outside.secret not in out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_no_slirp4netns_outlives_its_sandbox(start_host, outside):
    host = own_host(start_host)
    box = create(host, "closed", spec={"network": True})
    first = entry_of(host, box).info["net_pid"]
    assert "slirp4netns" in open(f"/proc/{first}/cmdline").read()
    # a shell that exits is restarted with a network of its own; the old helper goes
    assert "started" in box.exec("kill -9 $$").output
    second = entry_of(host, box).info["net_pid"]
    assert second != first and wait_until(lambda: not _alive(first), 5)
    assert verdicts(box.exec(probe_command(outside.target)).output)[outside.target] == "OPEN"
    box.close()
    assert wait_until(lambda: not _alive(second), 5)
    # a kill -9 of the host: the exit fds close with it, every helper quits
    boxes = [create(host, f"killed-{i}", spec={"network": True}) for i in range(2)]
    helpers = [entry_of(host, b).info["net_pid"] for b in boxes]
    assert all(_alive(pid) for pid in helpers)
    host.proc.send_signal(signal.SIGKILL)
    host.proc.wait(timeout=10)
    assert wait_until(lambda: not any(_alive(pid) for pid in helpers), 10), helpers


def test_the_operator_can_turn_network_sandboxes_off(start_host, monkeypatch):
    host = own_host(start_host, env={"PRORL_SANDBOX_NETWORK": "off"})
    response = requests.post(f"{host.address}/sandboxes", timeout=30,
                             headers={"Authorization": f"Bearer {host.token}"},
                             json={"job_id": "off", "spec": {"network": True}})
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["type"] == "policy_denied" and "PRORL_SANDBOX_NETWORK=off" in error["message"]
    assert create(host, "plain").exec("echo fine").output == "fine\n"  # the rest still serves
    # the API refuses at submission (its settings in this process: the same rule, the same field)
    from config.settings import get_settings
    from sandboxes.policy import check_request_sandbox

    monkeypatch.setenv("PRORL_SANDBOX_NETWORK", "off")
    get_settings.cache_clear()
    try:
        with pytest.raises(Exception) as refused:
            check_request_sandbox({"runtime": "bwrap", "network": True})
        assert refused.value.to_dict()["field"] == "instance.sandbox.network"
    finally:
        monkeypatch.delenv("PRORL_SANDBOX_NETWORK")
        get_settings.cache_clear()


def test_a_missing_tool_is_an_error_never_the_hosts_network(monkeypatch, sandbox_root):  # noqa: F811
    from sandboxes.base import SandboxSpec
    from sandboxes.runtimes.bwrap import BwrapSandbox

    real = netns.tool
    monkeypatch.setattr(netns, "tool", lambda name: None if name == "slirp4netns" else real(name))
    before = set(os.listdir(sandbox_root))
    with pytest.raises(SandboxError, match="slirp4netns.*missing.*never used"):
        BwrapSandbox(SandboxSpec(network=True), "no-tool", {"root": str(sandbox_root)})
    assert set(os.listdir(sandbox_root)) == before  # nothing started, nothing left


def test_through_the_service_a_network_job_cannot_reach_redis(api, redis_url, outside):
    port = redis_port(redis_url)
    targets = [f"{a}:{port}" for a in ("127.0.0.1", "10.0.2.2")] + \
        [f"{net.split('/')[0]}:{port}" for net in netns.host_addresses() if not net.startswith("127.")]
    job = wait(api, submit(api, {"data_source": "shell", "sandbox": {"runtime": "bwrap", "network": True},
                                 "commands": [probe_command(outside.target, *targets),
                                              "cat /proc/net/tcp"]}))
    assert job["status"] == "completed", job
    probe, tcp = (step["output"] for step in job["result"]["steps"])
    assert verdicts(probe)[outside.target] == "OPEN" and outside.secret in probe, probe
    assert all(verdicts(probe)[t] == "BLOCKED" for t in targets), probe
    assert "NOAUTH" not in probe and "redis" not in probe.lower()
    assert listening_ports(tcp) == set()


def test_slirp4netns_leaves_the_hosts_namespace_mounts_alone():
    """A network sandbox's slirp4netns, started as root, took every ``ip netns`` mount of the host
    away (/run/netns/NAME, where /run is no mount point of its own: its ``--enable-sandbox``
    unmounted them through the shared /run/netns). Started in a private mount namespace, it
    unmounts nothing of the host's."""
    name = f"prorl-probe-{os.getpid()}"
    _ip("netns", "add", name)
    holder = subprocess.Popen(["unshare", "--net", "sleep", "120"])
    try:
        path = f"/proc/{holder.pid}/ns/net"
        assert wait_until(lambda: os.stat(path).st_ino != os.stat("/proc/self/ns/net").st_ino, 10)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            net = netns.start_slirp(fd, None)
            net.close()
        finally:
            os.close(fd)
        with open("/proc/self/mountinfo") as fh:
            mounted = [line.split()[4] for line in fh]
        assert f"/run/netns/{name}" in mounted
    finally:
        holder.kill()
        holder.wait()
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
