"""The service's Redis as an attacker meets it (rows 1, 4, 16): no password, no answer; with the
password, no MODULE LOAD, no CONFIG SET dir, no DEBUG; not root; its AOF, the secrets file and the
state directory closed to other users; no secret in any process's argv."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import redis

from prorl_celery import keys
from prorl_celery.ops.launcher import Stack, StackOptions
from prorl_celery.statedir import UnsafeStateDir

NOBODY = 65534


def resp(host: str, port: int, *commands: list[str]) -> bytes:
    """Raw RESP commands on one connection, as a client without redis-py (or the password) would."""
    payload = b"".join(b"*%d\r\n" % len(cmd) + b"".join(b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode())
                                                        for a in cmd) for cmd in commands)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def test_redis_without_the_password_answers_nothing(stack, redis_url):
    """Row 1: HGETALL of a sandbox host's key gave its token to anyone on the network."""
    parts = urlsplit(redis_url)
    authed = redis.Redis.from_url(redis_url, decode_responses=True)
    host_id = authed.zrange(keys.hosts(), 0, 0)[0]
    token = authed.hget(keys.host(host_id), "token")
    assert token  # the secret is there, for whoever has the password
    reply = resp(parts.hostname, parts.port, ["HGETALL", keys.host(host_id)], ["KEYS", "*"],
                 ["AUTH", "wrong-password"], ["HGETALL", keys.host(host_id)])
    assert token.encode() not in reply and host_id.encode() not in reply, reply
    assert reply.count(b"-NOAUTH") == 3 and b"WRONGPASS" in reply, reply
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=parts.hostname, port=parts.port).ping()


def test_dangerous_commands_are_refused_even_with_the_password(redis_url, tmp_path):
    """Row 4: MODULE LOAD of a workspace .so, CONFIG SET dir to plant a file, DEBUG."""
    client = redis.Redis.from_url(redis_url)
    plant = tmp_path / "planted"
    plant.mkdir(mode=0o777)
    os.chmod(plant, 0o777)
    attempts = [("MODULE", "LOAD", str(tmp_path / "evil.so")), ("MODULE", "LIST"),
                ("CONFIG", "SET", "dir", str(plant)), ("CONFIG", "SET", "dbfilename", "x.so"),
                ("CONFIG", "GET", "*"), ("DEBUG", "SLEEP", "0"), ("DEBUG", "OBJECT", "x")]
    for command in attempts:
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.execute_command(*command)
    client.save()  # a SAVE after the attempts writes where Redis kept its data, not in `plant`
    assert list(plant.iterdir()) == []
    assert client.ping()  # the service's own commands still work


def _redis_process(redis_url: str) -> psutil.Process:
    port = urlsplit(redis_url).port
    return next(p for p in psutil.process_iter(["name"]) if p.info["name"] == "redis-server"
                and any(c.laddr.port == port for c in p.net_connections("tcp")))


def test_redis_runs_unprivileged_on_loopback(redis_url):
    proc = _redis_process(redis_url)
    if os.geteuid() == 0:
        assert proc.uids().real != 0 and proc.uids().effective != 0, proc.uids()
    listening = [c.laddr.ip for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert listening and all(ip.startswith("127.") or ip == "::1" for ip in listening), listening
    environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
    assert urlsplit(redis_url).password.encode() not in environ


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                          capture_output=True, timeout=30)


@pytest.fixture
def durable_redis(tmp_path):
    """A persisting private Redis (AOF), as ``up`` starts it, in a fresh state directory."""
    stack = Stack(StackOptions(state_dir=tmp_path / "state", persist=True))
    stack.start_redis()
    yield stack
    stack.stop()


def test_state_dir_secrets_and_aof_are_private(durable_redis):
    """Row 16: a state dir made with the default umask left the AOF (holding tokens) world-readable."""
    stack = durable_redis
    client = redis.Redis.from_url(stack.redis_url)
    client.hset("prorl:host:probe", "token", "the-host-token")
    client.execute_command("BGREWRITEAOF")
    state = stack.state_dir
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "logs").stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "redis").stat().st_mode) == 0o700
    assert stat.S_IMODE(stack.secrets_path.stat().st_mode) == 0o600
    assert stack.redis_password in stack.secrets_path.read_text()
    aof = [p for p in (state / "redis").rglob("*") if p.is_file() and "appendonly" in p.name]
    assert aof, list((state / "redis").rglob("*"))
    for path in aof:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, (path, oct(path.stat().st_mode))
    if os.geteuid() == 0:  # another local user tries to read them
        for path in [stack.secrets_path, *aof]:
            done = _as_nobody("cat", str(path))
            assert done.returncode != 0 and b"the-host-token" not in done.stdout
            assert stack.redis_password.encode() not in done.stdout


def test_unsafe_state_dir_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeStateDir, match="writable by other users"):
        Stack(StackOptions(state_dir=shared))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere-dir", target_is_directory=True)
    (tmp_path / "elsewhere-dir").mkdir()
    with pytest.raises(UnsafeStateDir, match="symlink"):
        Stack(StackOptions(state_dir=link))
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, NOBODY, NOBODY)
        with pytest.raises(UnsafeStateDir, match="owned by uid"):
            Stack(StackOptions(state_dir=theirs))
    assert not (shared / "logs").exists() and not (tmp_path / "elsewhere-dir" / "logs").exists()


def test_no_password_or_token_in_any_argv(stack, redis_url):
    """``ps`` shows every process's argv to every local user."""
    secrets = [urlsplit(redis_url).password, stack.api_token]
    family = psutil.Process().children(recursive=True)
    assert len(family) >= 8, [p.cmdline() for p in family]  # redis, host, 4 workers, beat, api
    for proc in family:
        try:
            argv = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        assert not any(s in argv for s in secrets), argv
