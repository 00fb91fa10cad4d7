from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import psutil
import pytest
import requests

from prorl_celery import keys
from prorl_celery.errors import InvalidRequest, NoSandboxCapacity, SandboxGone
from sandboxes.base import ExecResult, SandboxHandle, SandboxSpec
from sandboxes.protocol import METHODS, StatResult
from sandboxes.client import RemoteSandbox, close_handle, list_sandboxes, open_sandbox, request
from tests.sandboxes.conftest import wait_until


def create(host, job_id: str = "job-1", **body) -> RemoteSandbox:
    response = request("POST", host.address, host.token, "/sandboxes", 30,
                       data=json.dumps({"job_id": job_id, **body}))
    assert response.status_code == 201
    entry = response.json()
    return RemoteSandbox(SandboxHandle(host_id=entry["host_id"], address=host.address,
                                       token=host.token, sandbox_id=entry["sandbox_id"],
                                       runtime=entry["runtime"]))


def entry_of(host, sandbox: RemoteSandbox):
    return next(e for e in list_sandboxes(host.address, host.token)
                if e.sandbox_id == sandbox.handle.sandbox_id)


def test_token_required_except_health(start_host):
    host = start_host()
    assert requests.get(f"{host.address}/health").json()["capacity"] == 4
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = requests.get(f"{host.address}/sandboxes", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "unauthorized"
        response = requests.post(f"{host.address}/sandboxes", json={"job_id": "x"}, headers=headers)
        assert response.status_code == 401
    assert list_sandboxes(host.address, host.token) == []


def test_create_exec_files_close(start_host):
    host = start_host()
    sandbox = create(host, spec={"env": {"GREETING": "hi there"}})
    assert sandbox.exec('echo "$GREETING"; cd /tmp').output == "hi there\n"
    assert sandbox.exec("pwd").output == "/tmp\n"
    failed = sandbox.exec("exit 5")
    assert failed.exit_code == 5
    data = bytes(range(256)) * 100
    sandbox.write_file("sub/blob.bin", data)
    assert sandbox.read_file("sub/blob.bin") == data
    assert sandbox.exec("cd ~ && sha256sum sub/blob.bin").exit_code == 0
    with pytest.raises(FileNotFoundError):
        sandbox.read_file("nope.txt")
    info = sandbox.info()
    assert info["runtime"] == "bwrap"  # "auto" picks bwrap where it works
    assert info["isolation"] == "namespaces" and info["host_id"] == host.host_id
    assert sandbox.close() is True
    assert wait_until(lambda: not psutil.pid_exists(info["pid"]), timeout=2)
    assert wait_until(lambda: not os.path.exists(info["workspace"]), timeout=5)  # torn down after DELETE
    assert sandbox.close() is False  # idempotent
    assert close_handle(sandbox.handle) is False
    with pytest.raises(SandboxGone):
        sandbox.exec("echo hi")


def test_bad_requests_are_typed_errors(start_host):
    host = start_host()
    response = requests.post(f"{host.address}/sandboxes", data=b"{not json",
                             headers={"Authorization": f"Bearer {host.token}"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request"
    with pytest.raises(InvalidRequest):
        request("POST", host.address, host.token, "/sandboxes", 10,
                data=json.dumps({"job_id": "j", "spec": {"bogus": 1}}))
    response = requests.post(f"{host.address}/sandboxes",
                             json={"job_id": "j", "spec": {"runtime": "nope"}},
                             headers={"Authorization": f"Bearer {host.token}"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "unknown_plugin"
    assert "local" in response.json()["error"]["message"]
    response = requests.post(f"{host.address}/sandboxes/deadbeef/exec", json={"command": "ls"},
                             headers={"Authorization": f"Bearer {host.token}"})
    assert response.status_code == 404 and response.json()["error"]["type"] == "sandbox_gone"


def test_one_route_serves_every_protocol_method(start_host):
    """``POST /sandboxes/<id>/<method>`` for each row of protocol.METHODS: the body is that
    method's request model (extra fields refused), the answer its response model."""
    host = start_host()
    sandbox = create(host)
    headers = {"Authorization": f"Bearer {host.token}"}
    base = f"{host.address}/sandboxes/{sandbox.handle.sandbox_id}"
    for name in METHODS:
        reply = requests.post(f"{base}/{name}", json={"bogus": 1}, headers=headers, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request", name
    reply = requests.post(f"{base}/no_such_method", json={}, headers=headers, timeout=30)
    assert reply.status_code == 404 and "stat" in reply.json()["error"]["message"]
    reply = requests.post(f"{base}/exec", json={"command": "printf hi > f"}, headers=headers, timeout=30)
    assert ExecResult.model_validate(reply.json()).exit_code == 0
    reply = requests.post(f"{base}/stat", json={"path": "f"}, headers=headers, timeout=30)
    assert StatResult.model_validate(reply.json()).size == 2
    reply = requests.post(f"{base}/write_file", params={"path": "g"}, data=b"\x00\xff", headers=headers)
    assert reply.json() == {"written": True}
    reply = requests.post(f"{base}/read_file", json={"path": "g"}, headers=headers, timeout=30)
    assert reply.content == b"\x00\xff" and reply.headers["Content-Type"] == "application/octet-stream"
    # the paths callers already use still answer: GET/PUT .../files, DELETE the sandbox
    reply = requests.get(f"{base}/files", params={"path": "f"}, headers=headers, timeout=30)
    assert reply.content == b"hi"
    assert requests.put(f"{base}/files", params={"path": "h"}, data=b"x", headers=headers).ok
    assert sandbox.read_file("h") == b"x"
    closed = requests.delete(base, headers=headers, timeout=30).json()  # usage: null where no cgroup measured it
    assert closed["closed"] is True and set(closed) == {"closed", "usage"}
    assert requests.post(f"{base}/close", json={}, headers=headers, timeout=30).json() == {"closed": False, "usage": None}
    reply = requests.post(f"{base}/stat", json={"path": "f"}, headers=headers, timeout=30)
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "sandbox_gone"


def test_lapsed_lease_is_reaped(start_host):
    host = start_host()
    sandbox = create(host, lease_s=1)
    entry = entry_of(host, sandbox)
    assert entry.expires_at - entry.created_at == pytest.approx(1, abs=0.2)
    workspace, pid = entry.info["workspace"], entry.pid
    assert os.path.isdir(workspace) and psutil.pid_exists(pid)
    assert wait_until(lambda: not psutil.pid_exists(pid), timeout=5)
    assert wait_until(lambda: not os.path.exists(workspace), timeout=5)  # deleted by the teardown
    with pytest.raises(SandboxGone):
        sandbox.exec("echo hi")


def test_long_exec_and_renew_keep_lease(start_host):
    host = start_host()
    sandbox = create(host, lease_s=1)
    assert sandbox.exec("sleep 2.5; echo done", timeout=10).output == "done\n"
    for _ in range(3):
        time.sleep(0.6)
        sandbox.renew()
    assert sandbox.exec("echo still here").output == "still here\n"


def test_sigterm_closes_everything_and_deregisters(start_host, redis_client):
    host = start_host()
    sandboxes = [create(host, f"job-{i}") for i in range(2)]
    entries = [entry_of(host, s) for s in sandboxes]
    assert redis_client.exists(keys.host(host.host_id))
    assert host.stop(signal.SIGTERM) == 0
    for entry in entries:
        assert not psutil.pid_exists(entry.pid) and not os.path.exists(entry.info["workspace"])
    assert redis_client.zscore(keys.hosts(), host.host_id) is None
    assert not redis_client.exists(keys.host(host.host_id))


@pytest.mark.parametrize("runtime", ["local", "bwrap"])
def test_kill_9_of_host_kills_its_shells_and_what_they_run(start_host, sandbox_root, runtime):
    """Idle shells and a command that is running (with a child of its own) all die with the host."""
    if runtime == "bwrap" and not shutil.which("bwrap"):
        pytest.skip("bwrap is not installed")
    host = start_host(runtime=runtime)
    boxes = [create(host, f"job-{i}") for i in range(3)]
    entries = [entry_of(host, box) for box in boxes]
    assert all(e.info["workspace"].startswith(f"{sandbox_root}/{host.host_id}/") for e in entries)
    pids = [e.pid for e in entries]
    marker = f"sleep {600 + os.getpid() % 1000}"
    threading.Thread(target=lambda: _ignore_errors(boxes[0].exec, f"{marker} & {marker}; wait", 300),
                     daemon=True).start()
    assert wait_until(lambda: len(_running(marker)) == 2, timeout=10)
    assert all(psutil.pid_exists(pid) for pid in pids)
    host.stop(signal.SIGKILL)
    assert wait_until(lambda: not any(psutil.pid_exists(pid) for pid in pids) and not _running(marker),
                      timeout=5), _running(marker)


def _running(cmdline: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline", "status"])
            if " ".join(p.info["cmdline"] or []) == cmdline and p.info["status"] != psutil.STATUS_ZOMBIE]


def _ignore_errors(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the host is killed under it
        pass


def test_registration_and_heartbeat_in_redis(start_host, redis_client):
    host = start_host(capacity=3, heartbeat_s=0.3)
    record = {k.decode(): v.decode() for k, v in redis_client.hgetall(keys.host(host.host_id)).items()}
    assert record["address"] == host.address and record["token"] == host.token
    assert json.loads(record["runtimes"]) == ["bwrap", "local"]  # no singularity binary here
    assert (record["capacity"], record["live"]) == ("3", "0")
    first = redis_client.zscore(keys.hosts(), host.host_id)
    assert abs(first - time.time()) < 5
    create(host)
    assert wait_until(lambda: redis_client.hget(keys.host(host.host_id), "live") == b"1",
                      timeout=0.5)  # published on the change, not at the next heartbeat
    assert wait_until(lambda: redis_client.zscore(keys.hosts(), host.host_id) > first, timeout=3)


def test_the_live_count_is_written_once_per_burst_and_not_when_unchanged(sandbox_redis):
    """Creates and closes in quick succession cost the host's Redis one write per settle window,
    none when the count is back where it was; a change still shows within the window."""
    import redis

    from sandboxes.host.registration import PUBLISH_SETTLE_S, Registration
    from sandboxes.protocol import HostRecord

    writes: list[int] = []

    class Counted(redis.Redis):
        def hset(self, name, key=None, value=None, mapping=None, items=None):
            writes.append(value)
            return super().hset(name, key, value, mapping, items)

    class Pool:
        live = 0

    client, pool = Counted.from_url(sandbox_redis), Pool()
    record = HostRecord(host_id=f"count-{os.getpid()}", address="http://127.0.0.1:1", token="t",
                        runtimes=["local"], capacity=4, live=0)
    registration = Registration(client, record, pool, interval_s=60)
    registration.start()
    try:
        for _ in range(10):  # a create and its close, ten times, 4 ms apart
            pool.live = 1
            registration.update_live()
            time.sleep(0.004)
            pool.live = 0
            registration.update_live()
            time.sleep(0.004)
        time.sleep(3 * PUBLISH_SETTLE_S)
        assert len(writes) <= 3 and client.hget(keys.host(record.host_id), "live") == b"0"
        pool.live = 2
        registration.update_live()
        assert wait_until(lambda: client.hget(keys.host(record.host_id), "live") == b"2",
                          timeout=4 * PUBLISH_SETTLE_S)
        writes.clear()
        registration.update_live()  # nothing changed since
        time.sleep(3 * PUBLISH_SETTLE_S)
        assert writes == []
    finally:
        registration.remove()


def test_open_sandbox_places_by_free_capacity(start_host, redis_client):
    small, big = start_host(capacity=2), start_host(capacity=3)
    first = open_sandbox(redis_client, SandboxSpec(), "job-0")
    assert first.handle.host_id == big.host_id
    assert first.exec("echo placed").output == "placed\n"
    opened = [open_sandbox(redis_client, SandboxSpec(), f"job-{i}") for i in range(1, 5)]
    per_host = {h.host_id: len(list_sandboxes(h.address, h.token)) for h in (small, big)}
    assert per_host == {small.host_id: 2, big.host_id: 3}
    with pytest.raises(NoSandboxCapacity):
        open_sandbox(redis_client, SandboxSpec(), "job-full")
    assert opened[0].close() is True
    freed = opened[0].handle.host_id
    full = 2 if freed == small.host_id else 3
    # placement reads the live counts the hosts publish (asynchronously): wait for the close to show
    assert wait_until(lambda: int(redis_client.hget(keys.host(freed), "live")) == full - 1, timeout=5)
    assert open_sandbox(redis_client, SandboxSpec(), "job-again").handle.host_id == freed


def test_open_sandbox_skips_stale_dead_and_racing_hosts(start_host, redis_client):
    full, good = start_host(capacity=1), start_host(capacity=1)
    create(full)
    # full's record lies (as if stale): it looks like the roomiest host and is tried first.
    redis_client.hset(keys.host(full.host_id), mapping={"capacity": 50, "live": 0})
    # a host that stopped heart-beating and one that is registered but unreachable
    for host_id, beat in (("dead", time.time() - 3600), ("unreachable", time.time() + 60)):
        redis_client.hset(keys.host(host_id), mapping={
            "host_id": host_id, "address": "http://127.0.0.1:9", "token": "x",
            "runtimes": '["local"]', "capacity": 100, "live": 0})
        redis_client.zadd(keys.hosts(), {host_id: beat})
    sandbox = open_sandbox(redis_client, SandboxSpec(), "job-x")
    assert sandbox.handle.host_id == good.host_id
    assert sandbox.exec("echo ok").output == "ok\n"


def test_no_live_host_means_no_capacity(redis_client):
    with pytest.raises(NoSandboxCapacity):
        open_sandbox(redis_client, SandboxSpec(), "job-none")
    redis_client.hset(keys.host("unreachable"), mapping={
        "host_id": "unreachable", "address": "http://127.0.0.1:9", "token": "x",
        "runtimes": '["local"]', "capacity": 10, "live": 0})
    redis_client.zadd(keys.hosts(), {"unreachable": time.time()})
    with pytest.raises(NoSandboxCapacity, match="unreachable"):  # retried by init, not fatal
        open_sandbox(redis_client, SandboxSpec(), "job-none")


def test_wall_time_limit_closes_even_a_renewed_sandbox(start_host):
    host = start_host()
    sandbox = create(host, spec={"limits": {"wall_s": 1}})
    pid = entry_of(host, sandbox).pid
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and psutil.pid_exists(pid):
        try:
            sandbox.renew()
        except SandboxGone:
            break
        time.sleep(0.1)
    assert wait_until(lambda: not psutil.pid_exists(pid), timeout=1)
    with pytest.raises(SandboxGone):
        sandbox.renew()


def test_many_round_trips_through_the_host_each_get_their_own_output(start_host):
    """(Their speed is bench/action_latency.py's, not a test's.)"""
    sandbox = create(start_host())
    for i in range(200):
        result = sandbox.exec(f"echo {i}; (exit {i % 3})")
        assert (result.output, result.exit_code) == (f"{i}\n", i % 3)


def test_warm_sandboxes_are_claimed_with_the_jobs_settings(start_host):
    host = start_host(runtime="bwrap", warm=1)
    first = create(host, "job-cold")  # the first request of a kind starts warming that kind
    cold_pid = entry_of(host, first).pid
    assert wait_until(lambda: len(list_sandboxes(host.address, host.token)) == 1, timeout=1)
    time.sleep(0.5)  # the warm one starts in the background; it is not a live sandbox
    assert requests.get(f"{host.address}/health").json()["live"] == 1
    spec = {"env": {"TASK": "warm start"}, "workdir": "repo/src",
            "limits": {"memory_mb": 300, "nofile": 300}}  # memory: a cgroup where root; nofile: an rlimit
    asked_at = time.time()
    second = create(host, "job-warm", spec=spec)
    entry = entry_of(host, second)
    assert entry.job_id == "job-warm" and entry.info["job_id"] == "job-warm"
    assert entry.pid != cold_pid
    assert psutil.Process(entry.pid).create_time() < asked_at  # it was running before the ask
    out = second.exec('echo "$TASK"; pwd; ulimit -n').output
    assert out == "warm start\n/workspace/repo/src\n300\n"
    # exit only ends the command's subshell; killing the shell itself forces a new one, which
    # keeps the job's environment and limits
    restarted = second.exec("kill -9 $$")
    assert "new shell" in restarted.output
    assert second.exec('echo "$TASK"; ulimit -n').output == "warm start\n300\n"


def test_close_and_finish_say_what_the_cgroup_counted(start_host):
    """The host reads the sandbox's cgroup (cpuacct.usage, memory.max_usage_in_bytes) on demand
    in info and at close; the close's reading is what the cgroup's own files said; a local
    sandbox has no cgroup: null, never a guess."""
    from pathlib import Path

    from sandboxes.runtimes.limits.cgroups import PREFIX, V1_ROOT, accounting, host_key

    if accounting() is None:
        pytest.skip("no cgroup v1 cpuacct here (or not root): sandboxes are not measured")
    host = start_host(capacity=4)
    sandbox = create(host, spec={"runtime": "bwrap"})
    burn = ("python3 -c 'import time\nb = b\"x\" * (100 << 20)\nt = time.process_time()\n"
            "while time.process_time() - t < 1.0: pass'")
    assert sandbox.exec(burn, timeout=30).exit_code == 0
    info = sandbox.info()
    workspace = Path(info["workspace"])  # <its runtime's root>/<name>: its cgroup's key and name
    group = Path(PREFIX) / host_key(str(workspace.parent)) / workspace.name
    cpu_s = int((V1_ROOT / accounting() / group / "cpuacct.usage").read_text()) / 1e9
    peak_mb = int((V1_ROOT / "memory" / group / "memory.max_usage_in_bytes").read_text()) / (1 << 20)
    assert 1.0 <= info["usage"]["cpu_s"] <= cpu_s + 1e-6 and info["usage"]["source"] == "cgroup"
    assert sandbox.close() is True
    usage = sandbox.usage
    assert cpu_s - 1e-6 <= usage.cpu_s <= cpu_s + 0.1 and usage.peak_memory_mb == pytest.approx(peak_mb, abs=0.01)
    assert usage.peak_memory_mb >= 100 and usage.sandboxes == 1
    finished = create(host, job_id="job-2", spec={"runtime": "bwrap"})
    finished.exec("head -c 30000000 /dev/zero > /tmp/fill; echo x > out.txt")
    answer = finished.finish(["out.txt"], 1000)
    assert answer.files["out.txt"] == b"x\n" and answer.usage.peak_memory_mb >= 28  # tmpfs pages count
    assert finished.usage == answer.usage and answer.usage.cpu_s > 0
    keeper = create(host, job_id="job-4", spec={"runtime": "bwrap"})  # a sidecar's use counts with its keeper's
    sidecar = create(host, job_id="job-4", keeper=keeper.handle.sandbox_id, spec={"runtime": "bwrap"})
    sidecar.exec("head -c 20000000 /dev/zero > /tmp/fill")
    assert keeper.close() is True and keeper.usage.sandboxes == 2 and keeper.usage.peak_memory_mb >= 19
    local = create(host, job_id="job-3", spec={"runtime": "local"})
    assert local.info()["usage"] is None
    assert local.close() is True and local.usage is None
