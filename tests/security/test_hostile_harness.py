"""Issue 32: the harness is the attacker. Each section holds one area's attacks, launched where
the class is reached from: a ``command`` harness inside a real bwrap sandbox, through the whole
service, or the network a sandbox host or worker listens on. Each test failed on the code before
its fix."""
from __future__ import annotations

# --- gwframe ---
# The gateway's and the relay's framing and connections (issue 32 items 3 and 4, and from 8 the
# listen backlog and the socket directory).

import os  # noqa: E402
import secrets  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from types import SimpleNamespace  # noqa: E402


from config.settings import get_settings  # noqa: E402
from prorl_celery import handshake  # noqa: E402
from tests.conftest import submit, wait, wait_until  # noqa: E402
from tests.harnesses.test_command import agent_command  # noqa: E402
from tests.harnesses.test_mini_swe_agent import oracle_llm  # noqa: E402,F401 - the oracle backend fixture
from tests.sandboxes.conftest import needs_bwrap, sandbox_redis, sandbox_root, start_host  # noqa: E402,F401
from tests.sandboxes.test_host import create  # noqa: E402
from tests.sandboxes.test_relay import _gateway, node2_gateways  # noqa: E402,F401
from tests.security.hostile_gwframe import (HOLD, PUSH, listen_backlog, opened, reported,  # noqa: E402
                                            script, threads_of)


def _math(command: str) -> dict:
    return {"data_source": "math", "problem": "What is 1+1?", "answer": "2",
            "agent": {"harness": "command", "command": command, "wall_s": 300}}


def _run_workers(stack) -> list[int]:
    return [child.popen.pid for name, child in stack.children.items() if name.startswith("worker-run")]


@needs_bwrap()
def test_idle_connections_of_one_sandbox_make_no_threads_and_stop_no_other_session(api, stack, oracle_llm):
    """1,200 idle connections from one sandbox to its own gateway made 1,202 run-worker threads
    (a thread per connection, no head deadline). Now they cost the run worker no thread, at most
    ``Limits.connections`` of them are held, and another session's harness is answered meanwhile."""
    marker = f"{311 + os.getpid() % 89}.5"
    gate = os.path.join(get_settings().gateway_socket_dir, f"gate-{os.getpid()}-{secrets.token_hex(6)}")
    before = threads_of(_run_workers(stack))
    try:
        job = submit(api, _math(script("HOLD", HOLD, "1200", '"$PRORL_GATEWAY_SOCKET"', marker, gate)))
        wait_until(lambda: opened(marker), 120, "the attacker's connections to be open")
        during = threads_of(_run_workers(stack))
        honest = wait(api, submit(api, _math(agent_command(1))), timeout=120)
    finally:
        open(gate, "w").close()
    view = wait(api, job, timeout=120)
    os.unlink(gate)
    held = reported(view["result"]["harness"]["output"], "HOLD")
    assert held["opened"] + held["failed"] == 1200 and held["opened"] >= 1000, held  # it really connected
    assert during - before < 100, (before, during)  # not a thread per connection
    assert held["held"] <= 64, held  # the session's cap
    assert honest["status"] == "completed" and honest["result"]["turns"] == 1, honest["result"]


@needs_bwrap()
def test_a_body_is_not_read_before_the_credential_nor_past_the_cap(api, oracle_llm):
    """An unauthenticated chunked request with one 256 MB chunk passed the 64 MB cap (the body was
    read before the credential, and the chunk's announced size trusted). Now: refused from the
    head without a credential, and with one, refused once the running total passes the cap (a
    Content-Length past it, from the head)."""
    view = wait(api, submit(api, _math(script("PUSH", PUSH))), timeout=240)
    pushed = reported(view["result"]["harness"]["output"], "PUSH")
    assert pushed["anonymous"]["sent_mb"] < 16 and pushed["anonymous"]["status"] in ("401", "none"), pushed
    assert pushed["chunked"]["sent_mb"] < 64 + 16 and pushed["chunked"]["status"] in ("413", "none"), pushed
    assert pushed["length"]["sent_mb"] < 16 and pushed["length"]["status"] in ("413", "none"), pushed


@needs_bwrap()
def test_relay_idle_connections_make_no_threads_in_the_host(start_host, node2_gateways):
    """Through the relay, 600 idle connections from one sandbox made 1,202 threads in the root
    sandbox host that serves every sandbox of its node. Now the host's threads do not grow with
    them, the relay holds at most its cap, and another session's relay on the host answers."""
    host = start_host(env={"PRORL_GATEWAY_SOCKET_DIR": str(node2_gateways)})
    sandbox = create(host)
    ctx = SimpleNamespace(sandbox=sandbox, job_id="job-hostile-relay")
    gateways = [_gateway(), _gateway()]
    marker = f"{421 + os.getpid() % 89}.5"
    gate = node2_gateways / f"gate-{secrets.token_hex(6)}"
    from tasks.harnesses.run import _reach

    box: dict = {}
    try:
        paths = []
        for gateway in gateways:
            route, path = _reach(ctx, gateway)
            gateway.start()
            assert route == "relay", route
            paths.append(path)
        before = threads_of([host.proc.pid])
        command = script("HOLD", HOLD, "600", paths[0], marker, str(gate), paths[1], gateways[1].token)
        runner = threading.Thread(target=lambda: box.update(result=sandbox.exec(command, timeout=300)))
        runner.start()
        wait_until(lambda: opened(marker), 120, "the attacker's connections to be open")
        during = threads_of([host.proc.pid])
        gate.write_text("")
        runner.join(300)
    finally:
        gate.write_text("")
        for gateway in gateways:
            gateway.close()
        sandbox.close()
    held = reported(box["result"].output, "HOLD")
    assert held["opened"] >= 500, held
    assert during - before < 20, (before, during)
    assert held["held"] <= 64, held
    assert held["other"] == "200", held


def _stranger(address: str, source: str = "127.0.0.1") -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect((host, int(port)))
    return sock


def test_the_relay_listener_reads_nothing_before_the_handshake(tmp_path):
    """The gateway's relay listener is on the worker node's routable address: it read bodies and
    held connections from anyone on the cluster network before any credential. Now it opens with
    a challenge and reads no more than the answer's 64 bytes of a connection that does not prove
    the session's relay key (even one that sends the session's own credential); connections not
    through the handshake are capped per peer; a relay with the key is served, one without is not."""
    from sandboxes.host.relay import Relay

    gateway = _gateway()
    address = gateway.listen_tcp("127.0.0.1")
    gateway.start()
    target = (address.rsplit(":", 1)[0], int(address.rsplit(":", 1)[1]))
    try:
        sock = _stranger(address)
        body = b"x" * (8 << 20)
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + gateway.token.encode()
                + b"\r\nContent-Length: %d\r\n\r\n" % len(body))
        sent = 0
        try:
            sock.sendall(head)
            for k in range(0, len(body), 1 << 16):
                sent += sock.send(body[k:k + (1 << 16)])
        except OSError:
            pass
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except OSError:
            pass
        sock.close()
        assert data.startswith(handshake.MAGIC) and b"HTTP/" not in data, data[:80]
        assert sent < (4 << 20), sent  # refused after its 64 bytes: the rest met a closed connection
        # a peer holding connections it never takes through the handshake: only a few are kept
        held = [_stranger(address, "127.0.0.2") for _ in range(40)]
        assert sum(_challenged(sock) for sock in held) <= 8
        for key, expected in ((bytes.fromhex(gateway.relay_key), "200"), (secrets.token_bytes(32), "none")):
            path = str(tmp_path / f"{secrets.token_hex(16)}.sock")
            relay = Relay(path, target, key)
            try:
                assert _models(path, gateway.token) == expected
            finally:
                relay.close()
        for sock in held:
            sock.close()
        assert listen_backlog(gateway.socket_path) >= 128  # the listen backlog was 5
    finally:
        gateway.close()


def _challenged(sock: socket.socket) -> bool:
    """Whether the gateway opened the handshake on ``sock`` (and so holds it), not closed it."""
    sock.settimeout(2)
    data = b""
    try:
        while len(data) < handshake.CHALLENGE and (chunk := sock.recv(handshake.CHALLENGE - len(data))):
            data += chunk
    except OSError:
        pass
    return len(data) == handshake.CHALLENGE


def _models(path: str, token: str) -> str:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(15)
    sock.connect(path)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer "
                 + token.encode() + b"\r\n\r\n")
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    sock.close()
    return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "none"


def test_a_gateway_socket_directory_under_tmp_is_refused_at_startup(tmp_path):
    """A ``PRORL_GATEWAY_SOCKET_DIR`` under /tmp is hidden by every sandbox's own /tmp: relayed
    harnesses broke silently. A node's process now refuses to start with it, and says why."""
    env = {**os.environ, "PRORL_GATEWAY_SOCKET_DIR": str(tmp_path / "gateways")}
    proc = subprocess.Popen([sys.executable, "-m", "sandboxes.host.main", "--no-register", "--port", "0",
                             "--runtimes", "local"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode not in (0, None) and "ready" not in out, (out, err[-2000:])
    assert "PRORL_GATEWAY_SOCKET_DIR" in err and "under /tmp" in err, err[-2000:]
