"""bwrap sandboxes attacked from the inside, through a real sandbox host over HTTP."""
from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
import requests

from sandboxes.base import SandboxSpec
from sandboxes.runtimes.bwrap import BwrapConfig, BwrapSandbox, bwrap_argv
from sandboxes.client import RemoteSandbox
from tests.rootfs import build_rootfs
from tests.sandboxes.conftest import needs_bwrap
from tests.sandboxes.test_host import create, entry_of

pytestmark = needs_bwrap()


def host_uid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(line for line in fh if line.startswith("Uid:")).split()[1])


def test_command_line():
    config = BwrapConfig(ro_binds={"/data/cache": "/cache"}, tmp_size_mb=64)
    root = [("/usr", None), ("/bin", "usr/bin")]
    argv = bwrap_argv(config, workspace_dir="/w/ws-1", workdir="/workspace/repo", network=False,
                      root=root, uid=1000007)
    assert argv[:5] == [argv[0], "--reuid=1000007", "--regid=1000007", "--clear-groups", "--"]
    bwrap = argv[5:]
    assert os.path.isabs(bwrap[0]) and bwrap[0].endswith("/bwrap")  # never looked up in a PATH
    assert bwrap[1:4] == ["--unshare-all", "--unshare-user", "--disable-userns"]
    assert "--share-net" not in bwrap
    joined = " ".join(bwrap)
    for part in ("--die-with-parent", "--new-session", "--cap-drop ALL", "--uid 0 --gid 0", "--clearenv",
                 "--ro-bind /usr /usr", "--symlink usr/bin /bin", "--ro-bind /data/cache /cache",
                 "--proc /proc --dev /dev", f"--size {64 << 20} --tmpfs /tmp",
                 "--bind /w/ws-1 /workspace", "--remount-ro / --chdir /workspace/repo",
                 "bash --noprofile --norc"):
        assert part in joined, part
    with_net = bwrap_argv(config, workspace_dir="/w", workdir="/workspace", network=True, root=root,
                          image="/images/u22", uid=None, env={"HOME": "/workspace"},
                          resolv="/run/prorl/resolv.conf")
    assert with_net[0].endswith("/bwrap") and "--share-net" not in with_net  # its own netns
    joined = " ".join(with_net)
    assert "--ro-bind /images/u22/usr /usr" in joined
    assert "--clearenv --setenv HOME /workspace" in joined
    assert "--ro-bind /run/prorl/resolv.conf /etc/resolv.conf" in joined


def test_escapes_fail_and_the_host_is_untouched(start_host):
    box = create(start_host(runtime="bwrap"))
    attempts = {
        "remount": "mount -o remount,rw,bind /usr",
        "nested userns": "unshare -U -r true",
        "sysctl": "echo 1 > /proc/sys/kernel/sysrq",
        "dev node": "touch /dev/evil",
        "root dir": "mkdir /evil",
        "chroot": "chroot / true",
    }
    for what, command in attempts.items():
        result = box.exec(command)
        assert result.exit_code != 0, (what, result.output)
    assert not os.path.exists("/evil") and not os.path.exists("/dev/evil")
    status = box.exec("grep -E '^(CapEff|CapBnd)' /proc/self/status").output
    assert status.split() == ["CapEff:", "0000000000000000", "CapBnd:", "0000000000000000"]


def test_sandboxes_see_neither_the_host_nor_each_other(start_host):
    host = start_host(runtime="bwrap")
    first, second = create(host, "job-a"), create(host, "job-b")
    first.write_file("secret-a.txt", b"only for a")
    workspace_a = entry_of(host, first).info["workspace"]
    assert second.exec("find / -name 'secret-a*' 2>/dev/null | head -1").output == ""
    assert second.exec(f"ls {workspace_a} 2>&1").exit_code != 0
    listing = second.exec("ps -e -o pid=,comm=").output.split("\n")
    assert [line.split()[1] for line in listing if line.strip()] == ["bwrap", "bash", "bash", "ps"]  # the command's subshell
    # distinct unprivileged host uids: no sandbox runs as host root, none shares a uid
    uids = {host_uid(entry_of(host, box).info["shell_pid"]) for box in (first, second)}
    assert len(uids) == 2 and 0 not in uids if os.geteuid() == 0 else True
    assert second.exec("hostname").output == "sandbox\n"


def test_loopback_services_unreachable_without_network(start_host, sandbox_redis):
    port = int(sandbox_redis.rsplit(":", 1)[1].split("/")[0])
    probe = (f"python3 -c \"import socket; s = socket.create_connection(('127.0.0.1', {port}), 2); "
             f"s.sendall(b'PING\\r\\n'); print(s.recv(10))\"")
    host = start_host(runtime="bwrap")
    closed = create(host, "no-net").exec(probe)
    assert closed.exit_code != 0 and "refused" in closed.output
    # a network sandbox has its own network (tests/security/test_network.py): its loopback is its own
    isolated = create(host, "net", spec={"network": True}).exec(probe)
    assert isolated.exit_code != 0 and "PONG" not in isolated.output
    on_host = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=10)
    assert "PONG" in on_host.stdout  # the probe itself works


def test_fork_bomb_and_memory_hog_are_stopped_and_the_host_keeps_serving(start_host):
    host = start_host(runtime="bwrap")
    limits = {"nproc": 64, "memory_mb": 256, "fsize_mb": 1, "cpu_s": 2}
    bomb_box = create(host, "bomber", spec={"limits": limits})
    bystander = create(host, "bystander")
    health = []

    def poll_health() -> None:
        while len(health) < 1000 and not stop.is_set():
            started = time.monotonic()
            ok = requests.get(f"{host.address}/health", timeout=5).status_code == 200
            health.append((ok, time.monotonic() - started))
            time.sleep(0.05)

    stop = threading.Event()
    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        # the bomb's command runs into its timeout: the kill that follows takes every process the
        # command started (the sandbox's cgroup), so nothing of it is left to write into the next
        # command's output (a command that ends normally leaves its background jobs running, as
        # any shell does)
        bomb = bomb_box.exec("bomb() { bomb | bomb & }; bomb; sleep 30", timeout=4)
        # the bystander (another uid) can still fork while the bomb runs into its limit
        assert bystander.exec("for i in $(seq 20); do sleep 0.01 & done; wait; echo forked").output == "forked\n"
    finally:
        stop.set()
        poller.join()
    assert bomb.timed_out
    left = bomb_box.exec("ps -e -o comm= | grep -vc -e '^bwrap$' -e '^bash$' -e '^ps$' -e '^grep$'")
    assert left.output.strip() == "0", left.output  # no bomb process survived the timeout
    assert bomb_box.exec("echo survived").output == "survived\n"
    # every probe answered; on this 2-core machine, with the whole suite running beside the fork
    # bomb, one answer took 2.x s once, so the bound is the probe's own 5 s timeout minus a margin
    assert health and all(ok for ok, _ in health) and max(t for _, t in health) < 4
    hog = bomb_box.exec("python3 -c 'x = bytearray(1024 * 2**20)'")
    # RLIMIT_AS raises MemoryError; a memory cgroup (root host) OOM-kills the process instead
    assert hog.exit_code != 0 and ("MemoryError" in hog.output or "Killed" in hog.output)
    big = bomb_box.exec("head -c 5000000 /dev/zero > big; wc -c < big")
    assert int(big.output.strip().splitlines()[-1]) <= 1 << 20
    # SIGXCPU after 2 s of CPU (not of wall time: a loaded node gives the loop less than a core,
    # so the command's own timeout is far away and only the CPU limit can end it)
    spin = bomb_box.exec("while :; do :; done; echo never", timeout=300)
    assert not spin.timed_out and "never" not in spin.output and spin.exit_code != 0, spin


def test_requests_without_the_token_are_refused(start_host):
    host = start_host(runtime="bwrap")
    box = create(host)
    sandbox_id = box.handle.sandbox_id
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": host.token}):
        for method, path in (("POST", f"/sandboxes/{sandbox_id}/exec"),
                             ("GET", f"/sandboxes/{sandbox_id}/files?path=x"),
                             ("PUT", f"/sandboxes/{sandbox_id}/tree?path=x"),
                             ("DELETE", f"/sandboxes/{sandbox_id}")):
            response = requests.request(method, host.address + path, json={"command": "id"},
                                        headers=headers, timeout=5)
            assert response.status_code == 401, (method, path, headers)
    assert box.exec("echo still mine").output == "still mine\n"
    stolen = RemoteSandbox(box.handle.model_copy(update={"token": "guess"}))
    with pytest.raises(Exception, match="401"):
        stolen.close()


def test_an_image_rootfs_replaces_the_hosts(sandbox_root):
    image = sandbox_root / "image"
    image.mkdir()
    build_rootfs(image, tools=("bash", "cat"))
    os.chmod(image, 0o755)
    box = BwrapSandbox(SandboxSpec(image=str(image)), "img", {"root": str(sandbox_root)})
    try:
        assert box.exec("cat /etc/image-marker").output == "from the image\n"
        assert box.exec("ls /usr/bin/python3 2>&1 || echo no-python").output.endswith("no-python\n")
        assert box.exec("cat /etc/hostname 2>&1; echo $?").output.strip().endswith("1")
        box.write_file("note.txt", b"kept")
        assert box.exec("cat /workspace/note.txt").output == "kept"
    finally:
        box.close()
