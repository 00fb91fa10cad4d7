"""A harness session's gateway reached from a sandbox on another node: a real sandbox host whose
gateway directory is not this process's (its node's ``/run`` is its own) relays a socket of the
session's name to the gateway's TCP address, and a real bwrap sandbox on it talks to the real
gateway through that relay, with the session's credential and no other; the relay goes when it is
closed and with its sandbox. A host that shares the directory gets no relay (``direct``)."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from prorl_celery.errors import InvalidRequest, SandboxGone
from prorl_celery.gateway import Gateway, GatewaySession
from sandboxes.client import HostProvider
from tasks.harnesses.run import _socket_path
from tests.sandboxes.conftest import wait_until
from tests.sandboxes.test_host import create

MODEL = "relayed-model"
KEY = secrets.token_hex(32)
# what a harness's HTTP client does, in the sandbox: one request on the session's socket
CALL = r'''
import socket, sys
path, token = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(path)
except OSError as exc:
    print("UNREACHABLE", type(exc).__name__); sys.exit(0)
body = b"x" * 300000  # a harness's prompt is large: bytes must cross the relay both ways whole
s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer " + token.encode()
          + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
data = b""
while chunk := s.recv(65536):
    data += chunk
print("STATUS", data.split(b" ", 2)[1].decode())
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer " + token.encode() + b"\r\nConnection: close\r\n\r\n")
data = b""
while chunk := s.recv(65536):
    data += chunk
print("MODELS", data.split(b" ", 2)[1].decode(), b"''' + MODEL.encode().decode() + r'''" in data)
'''


@pytest.fixture
def node2_gateways():
    """The gateway directory of "another node" (a directory this process's settings do not name;
    under /run as the real one is: a sandbox's /tmp is its own)."""
    path = Path(tempfile.mkdtemp(prefix="prorl-node2-gateways-", dir="/run"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _gateway() -> Gateway:
    never = lambda req, stop: (_ for _ in ()).throw(AssertionError("no generation in this test"))  # noqa: E731
    session = GatewaySession(f"relay-{secrets.token_hex(4)}", never, log=None)
    return Gateway(session, token=secrets.token_urlsafe(16), model=MODEL, socket_path=_socket_path())


def _call(sandbox, path: str, token: str) -> dict[str, str]:
    result = sandbox.exec(f"python3 -I - {path} {token} <<'PY'\n{CALL}\nPY", timeout=60)
    assert result.exit_code == 0, result.output
    return {line.split()[0]: " ".join(line.split()[1:]) for line in result.output.splitlines() if line}


def test_a_sandbox_on_another_node_reaches_its_gateway_through_its_host(start_host, node2_gateways):
    host = start_host(env={"PRORL_GATEWAY_SOCKET_DIR": str(node2_gateways)})
    sandbox = create(host)
    provider = HostProvider(None)
    gateway = _gateway()
    try:
        route, path = provider.gateway_route(sandbox, gateway.socket_path, gateway.listen_tcp, gateway.relay_key)
        gateway.start()
        name = os.path.basename(gateway.socket_path)
        assert route == "relay" and path == str(node2_gateways / name), (route, path)
        assert os.path.exists(path) and gateway.socket_path != path
        seen = _call(sandbox, path, gateway.token)
        # the chat call reached the gateway whole (it parsed the 300 kB body: not JSON, a 400), and the answer came back
        assert seen["STATUS"] == "400" and seen["MODELS"] == "200 True", seen
        assert _call(sandbox, path, "not-the-token")["STATUS"] == "401"
        # the worker's own socket is on its own node: the sandbox cannot see it
        assert _call(sandbox, gateway.socket_path, gateway.token)["UNREACHABLE"] == "FileNotFoundError"
        assert sandbox.relay(name).route == "relay"  # asked again: the same relay, no second one
        provider.close_gateway_route(sandbox, gateway.socket_path)
        assert not os.path.exists(path)
        assert _call(sandbox, path, gateway.token)["UNREACHABLE"] == "FileNotFoundError"
        # a relay left open goes with its sandbox
        assert sandbox.relay(name, target=gateway.relay_address, key=gateway.relay_key).route == "relay"
        assert os.path.exists(path)
        sandbox.close()
        assert wait_until(lambda: not os.path.exists(path), timeout=10)
    finally:
        gateway.close()
        sandbox.close()


def test_a_sandbox_on_the_workers_node_connects_directly(start_host):
    host = start_host()  # this process's gateway directory: the same node
    sandbox = create(host)
    gateway = _gateway()
    try:
        route, path = HostProvider(None).gateway_route(sandbox, gateway.socket_path, gateway.listen_tcp, gateway.relay_key)
        gateway.start()
        assert (route, path) == ("direct", gateway.socket_path) and gateway.relay_address is None  # no TCP listener
        assert _call(sandbox, path, gateway.token)["MODELS"] == "200 True"
    finally:
        gateway.close()
        sandbox.close()


def test_relay_requests_are_checked(start_host, node2_gateways):
    host = start_host(env={"PRORL_GATEWAY_SOCKET_DIR": str(node2_gateways)})
    sandbox = create(host)
    name = secrets.token_hex(16) + ".sock"
    try:
        for bad in ("../../etc/x.sock", "short.sock", "A" * 32 + ".sock", name + "/x", ""):
            with pytest.raises(InvalidRequest) as caught:
                sandbox.relay(bad, target="127.0.0.1:9")
            assert caught.value.field == "socket" and not os.listdir(node2_gateways), bad
        for bad in ("127.0.0.1", "127.0.0.1:0", "127.0.0.1:99999", ":80", "host:port"):
            with pytest.raises(InvalidRequest) as caught:
                sandbox.relay(name, target=bad)
            assert caught.value.field == "target", bad
        with pytest.raises(InvalidRequest) as caught:  # a relay proves the session's key, or is not made
            sandbox.relay(name, target="127.0.0.1:9")
        assert caught.value.field == "key"
        assert sandbox.relay(name).route == "none"  # nothing there, nothing asked
        (node2_gateways / name).write_text("a file, not a socket")
        with pytest.raises(InvalidRequest):  # a relay never replaces what is there
            sandbox.relay(name, target="127.0.0.1:9", key=KEY)
        assert (node2_gateways / name).read_text() == "a file, not a socket"
        # a gateway that is unreachable: the sandbox's connection is closed, nothing hangs
        other = secrets.token_hex(16) + ".sock"
        assert sandbox.relay(other, target="127.0.0.1:9", key=KEY).route == "relay"
        result = sandbox.exec(f"python3 -I - {node2_gateways / other} x <<'PY'\n{CALL}\nPY", timeout=60)
        assert "STATUS" not in result.output and result.exit_code != 0, result.output
    finally:
        sandbox.close()
    with pytest.raises(SandboxGone):
        sandbox.relay(name, target="127.0.0.1:9")
    assert json.dumps(sorted(os.listdir(node2_gateways))) == json.dumps([name])  # the closed sandbox's relay went


def test_the_gateway_directory_is_enterable_whatever_the_umask(node2_gateways, monkeypatch):
    """worker_node.sh runs everything under umask 077: a directory made with mode 0711 then is
    0700, and every sandbox uid is shut out of its own session's socket (seen on the multinode
    cluster: each harness on that node ended with a reset connection)."""
    from config.settings import get_settings
    from sandboxes.base import gateway_dir

    target = node2_gateways / "node-run" / "prorl-gateway"  # under /run: /tmp is refused
    monkeypatch.setenv("PRORL_GATEWAY_SOCKET_DIR", str(target))
    get_settings.cache_clear()
    old = os.umask(0o077)
    try:
        assert gateway_dir() == str(target)
        target.chmod(0o700)  # as a run under that umask left it before
        assert gateway_dir() == str(target)
    finally:
        os.umask(old)
        monkeypatch.undo()
        get_settings.cache_clear()
    assert stat.S_IMODE(target.stat().st_mode) == 0o711
