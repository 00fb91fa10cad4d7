"""Writable image roots (``writable_root``) in real bwrap sandboxes: the root is the sandbox's own
(an overlay over the id-mapped image), the image never changes, the host exports the sandbox's
files and reads what a grader wrote only once every process of the sandbox is dead."""
from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
import requests

from config.settings import get_settings
from prorl_celery.errors import FileTooLarge, SandboxError, SandboxGone
from sandboxes.base import SandboxSpec
from sandboxes.runtimes.bwrap import BwrapSandbox
from sandboxes.runtimes.limits import idmap
from tests.rootfs import build_rootfs
from tests.sandboxes.conftest import needs_bwrap, wait_until
from sandboxes.host.reap import mounts_under
from tests.sandboxes.test_host import create
from tests.sandboxes.test_reap import node  # noqa: F401 - the fixture: a root, a uid range, hosts on it

TOOLS = ("bash", "sh", "cat", "ls", "mkdir", "rm", "mv", "ln", "env", "id", "sleep", "true",
         "stat", "mkfifo", "chmod", "tail")

pytestmark = [needs_bwrap(), pytest.mark.skipif(bool(idmap.why_not()), reason=idmap.why_not() or "-")]


@pytest.fixture(scope="module")
def images() -> Path:
    """A directory of images (0755 all the way, as sandbox uids need): ``base`` is a small root
    made of host tools with an ``/etc/prorl-image.json``."""
    top = Path(tempfile.mkdtemp(prefix="prorl-test-images-"))
    top.chmod(0o755)
    base = top / "base"
    base.mkdir()
    build_rootfs(base, TOOLS)
    (base / "var" / "lib").mkdir(parents=True)
    (base / "etc" / "prorl-image.json").write_text(json.dumps(
        {"env": {"IMAGE_GREETING": "from the image", "LD_PRELOAD": "/evil.so"}, "workdir": "/app"}))
    base.chmod(0o755)
    yield top
    os.system(f"rm -rf {top}")


def digest(tree: Path) -> dict[str, tuple]:
    """Every entry of ``tree``: kind, mode, owner and content (or link target)."""
    out = {}
    for base, dirs, files in os.walk(tree):
        for name in dirs + files:
            path = Path(base) / name
            st = os.lstat(path)
            body = (os.readlink(path) if stat.S_ISLNK(st.st_mode) else
                    hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else "")
            out[str(path.relative_to(tree))] = (stat.S_IFMT(st.st_mode), st.st_mode, st.st_uid, body)
    return out


def open_box(images: Path, root: Path, **spec) -> BwrapSandbox:
    return BwrapSandbox(SandboxSpec(image=str(images / "base"), writable_root=True, **spec), "wr",
                        {"root": str(root)})


def test_the_root_is_writable_and_the_image_unchanged(images, sandbox_root):
    before = digest(images / "base")
    box = open_box(images, sandbox_root, workdir="/app")
    try:
        out = box.exec("id -u; pwd; echo made > /app/x && echo appended >> /etc/image-marker && "
                       "mkdir /var/lib/foo && stat -c %u /etc/image-marker /var/lib/foo && "
                       "cat /etc/image-marker /app/x")
        assert out.exit_code == 0, out.output
        assert out.output == "0\n/app\n0\n0\nfrom the image\nappended\nmade\n"
        # the image's own variables are the shell's defaults; a loader variable is not taken
        assert box.exec('echo "$IMAGE_GREETING|${LD_PRELOAD-unset}"').output == "from the image|unset\n"
    finally:
        box.close()
    assert digest(images / "base") == before


def test_two_sandboxes_of_one_image_do_not_see_each_others_changes(images, sandbox_root):
    first, second = open_box(images, sandbox_root), open_box(images, sandbox_root)
    try:
        first.exec("echo a > /etc/image-marker; mkdir -p /app && echo a > /app/only-a")
        second.exec("echo b >> /etc/image-marker")
        assert first.exec("cat /etc/image-marker").output == "a\n"
        assert second.exec("cat /etc/image-marker").output == "from the image\nb\n"
        assert second.exec("ls /app/only-a 2>&1").exit_code != 0
    finally:
        first.close()
        second.close()


def _mount_lines(pid: int | str = "self") -> list[str]:
    with open(f"/proc/{pid}/mountinfo") as fh:
        return fh.read().splitlines()


def test_close_removes_the_mounts_and_the_directories(images, sandbox_root):
    box = open_box(images, sandbox_root)
    box_dir, init_pid = Path(box.info()["workspace"]), box.info()["init_pid"]
    inside = _mount_lines(init_pid)
    root_line = next(line for line in inside if line.split()[4] == "/")
    assert " - overlay " in root_line  # the sandbox's root is the overlay
    assert (box_dir / "upper").is_dir() and (box_dir / "logs").is_dir()
    # never in the host's own mount table: only in the sandbox's namespace
    assert not [line for line in _mount_lines() if " - overlay " in line and str(box_dir) in line]
    box.exec("echo x > /app-file")
    assert (box_dir / "upper" / "app-file").exists()
    box.close()
    assert not os.path.exists(f"/proc/{init_pid}")
    assert not box_dir.exists() and not list(box_dir.parent.glob(f".trash-{box_dir.name}"))
    assert not [line for line in _mount_lines() if str(box_dir) in line]


def members_of(data: bytes) -> dict[str, tarfile.TarInfo]:
    return {info.name: info for info in tarfile.open(fileobj=io.BytesIO(data))}


def test_export_tree_carries_the_changes_and_follows_no_symlink(images, sandbox_root):
    box = open_box(images, sandbox_root)
    try:
        out = box.exec("mkdir -p /app/sub && echo one > /app/sub/one.txt && printf 'x' > /app/run.sh && "
                       "chmod 0750 /app/run.sh && ln -s /etc /app/etc-link && "
                       f"ln -s {sandbox_root} /app/host-link && ln -s ../../etc/image-marker /app/sub/rel && "
                       "mkfifo /app/pipe && ln -s /etc /app2")
        assert out.exit_code == 0, out.output
        tar = box.export_tree(["/app"], 1 << 20)
        members = members_of(tar)
        assert set(members) == {"app", "app/sub", "app/sub/one.txt", "app/run.sh", "app/etc-link",
                                "app/host-link", "app/sub/rel"}  # the FIFO is left out
        assert tarfile.open(fileobj=io.BytesIO(tar)).extractfile("app/sub/one.txt").read() == b"one\n"
        assert stat.S_IMODE(members["app/run.sh"].mode) == 0o750
        links = {name: info.linkname for name, info in members.items() if info.issym()}
        assert links == {"app/etc-link": "/etc", "app/host-link": str(sandbox_root),
                         "app/sub/rel": "../../etc/image-marker"}
        assert all(info.uid == 0 and info.gid == 0 for info in members.values())
        assert not any(name.startswith("/") or ".." in name.split("/") for name in members)
        # a symlink on the way to a path is refused; the symlink itself is only a symlink
        with pytest.raises(PermissionError):
            box.export_tree(["/app/etc-link/passwd"], 1 << 20)
        assert {n: i.issym() for n, i in members_of(box.export_tree(["/app2"], 1 << 20)).items()} == {"app2": True}
        assert members_of(box.export_tree(["/nowhere"], 1 << 20)) == {}
        box.exec("printf '%*s' 300000 '' > /app/big")
        with pytest.raises(FileTooLarge):
            box.export_tree(["/app"], 64 * 1024)
        box.write_file("notes.txt", b"in the workspace")
        both = members_of(box.export_tree(["/workspace/notes.txt", "/etc/image-marker"], 1 << 20))
        assert set(both) == {"workspace/notes.txt", "etc/image-marker"}
    finally:
        box.close()


def _uid_processes(uid: int) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                found.append(int(pid))
        except FileNotFoundError:
            pass
    return found


def test_finish_reads_only_once_every_process_is_dead(images, sandbox_root):
    box = open_box(images, sandbox_root)
    uid = box.info()["uid"]
    loop = ("mkdir -p /logs/verifier; i=0; while true; do i=$((i+1)); echo $i > /logs/verifier/r.tmp; "
            "mv -f /logs/verifier/r.tmp /logs/verifier/reward.txt; echo $i >> /logs/verifier/seq; done")
    box.exec(f"({loop}) > /dev/null 2>&1 &")
    assert wait_until(lambda: box.exec("tail -n 1 /logs/verifier/seq 2>/dev/null").output.strip()
                      .isdigit() and int(box.exec("tail -n 1 /logs/verifier/seq").output) > 20, 20)
    assert _uid_processes(uid)
    files = box.finish(["/logs/verifier/reward.txt", "/logs/verifier/seq", "/logs/none"], 1 << 20).files
    reward, seq = int(files["/logs/verifier/reward.txt"]), files["/logs/verifier/seq"].split()
    # read after the kill: the reward (read first) is the last value written, never one behind a
    # still-running writer's log (read second)
    assert int(seq[-1]) in (reward, reward - 1) and len(seq) > 20
    assert files["/logs/none"] is None
    assert _uid_processes(uid) == []
    with pytest.raises(SandboxGone):
        box.exec("true")


def test_finish_names_a_file_rewritten_while_it_settles(images, sandbox_root):
    box = open_box(images, sandbox_root)
    box.exec("mkdir -p /logs/verifier; echo 0 > /logs/verifier/done.txt; "
             "(while true; do echo 1 > /logs/verifier/reward.txt; sleep 0.01; done) > /dev/null 2>&1 &")
    done = box.finish(["/logs/verifier/reward.txt", "/logs/verifier/done.txt"], 1 << 20, settle_s=0.3)
    assert done.rewritten == ["/logs/verifier/reward.txt"]  # the file nobody wrote any more is not named
    assert done.mtimes_ns["/logs/verifier/done.txt"] <= done.killed_at_ns


def test_a_writable_root_may_listen_on_a_low_port_of_its_own_namespace(images, sandbox_root):
    box = open_box(images, sandbox_root)
    out = box.exec("cat /proc/sys/net/ipv4/ip_unprivileged_port_start")  # the image has no listener to try
    assert out.output.strip() == "0", out.output
    with open("/proc/sys/net/ipv4/ip_unprivileged_port_start") as f:  # the node's own is untouched
        assert int(f.read()) > 0
    box.close()


def test_gateway_dir_and_harness_root_reach_image_roots(images, sandbox_root, monkeypatch):
    run = Path(tempfile.mkdtemp(prefix="prorl-test-node-", dir="/run"))
    gateways, harnesses = run / "gw", run / "harnesses"
    harnesses.mkdir()
    (harnesses / "marker").write_text("a harness\n")
    run.chmod(0o755)
    harnesses.chmod(0o755)
    monkeypatch.setenv("PRORL_GATEWAY_SOCKET_DIR", str(gateways))
    monkeypatch.setenv("PRORL_HARNESS_ROOT", str(harnesses))
    get_settings.cache_clear()
    check = (f"test -d {gateways} && cat {harnesses}/marker && "
             f"(touch {harnesses}/x 2>/dev/null && echo writable || echo read-only)")
    try:
        box = open_box(images, sandbox_root)
        try:  # a writable root: the mount points are made
            assert box.exec(check).output == "a harness\nread-only\n"
        finally:
            box.close()
        plain = BwrapSandbox(SandboxSpec(image=str(images / "base")), "ro", {"root": str(sandbox_root)})
        try:  # a read-only root without the mount points goes without
            assert plain.exec(f"test -e {harnesses} || echo absent").output == "absent\n"
        finally:
            plain.close()
        with_points = images / "with-points"
        if not with_points.exists():
            os.system(f"cp -a {images / 'base'} {with_points}")
        for path in (gateways, harnesses):
            (with_points / str(path).lstrip("/")).mkdir(parents=True, exist_ok=True)
        ro = BwrapSandbox(SandboxSpec(image=str(with_points)), "ro", {"root": str(sandbox_root)})
        try:  # a read-only root with them: bound
            assert ro.exec(check).output == "a harness\nread-only\n"
        finally:
            ro.close()
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
        os.system(f"rm -rf {run}")


@pytest.mark.unit
def test_writable_root_needs_an_image():
    with pytest.raises(ValueError, match="writable_root"):
        SandboxSpec(writable_root=True)
    assert SandboxSpec(image="/images/x", writable_root=True).writable_root


def test_runtimes_without_it_refuse_it(sandbox_root):
    from sandboxes.runtimes.local import LocalSandbox

    with pytest.raises(SandboxError, match="not supported by the local runtime"):
        LocalSandbox(SandboxSpec(image="/images/x", writable_root=True), "j", {"root": str(sandbox_root)})


def test_a_host_that_is_not_root_refuses_it_saying_why(images, sandbox_root, monkeypatch):
    monkeypatch.setattr(idmap.os, "geteuid", lambda: 1000)
    idmap.why_not.cache_clear()
    try:
        with pytest.raises(SandboxError, match="not root.*id-mapped"):
            open_box(images, sandbox_root)
    finally:
        monkeypatch.undo()
        idmap.why_not.cache_clear()


def test_over_http_through_the_sandbox_host(images, start_host):
    host = start_host(runtime="bwrap", env={"PRORL_SANDBOX_IMAGE_DIRS": str(images)})
    headers = {"Authorization": f"Bearer {host.token}"}
    refused = requests.post(f"{host.address}/sandboxes", headers=headers, timeout=30,
                            json={"job_id": "j", "spec": {"writable_root": True}})
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request"
    assert "writable_root" in refused.json()["error"]["message"]
    box = create(host, spec={"image": str(images / "base"), "writable_root": True, "workdir": "/app"})
    assert box.exec("echo changed > /app/f && mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt"
                    " && pwd").output == "/app\n"
    assert members_of(box.export_tree(["/app"], 1 << 20)).keys() == {"app", "app/f"}
    box.exec("(while true; do echo 0 > /logs/verifier/late; sleep 0.01; done) &")
    files = box.finish(["/logs/verifier/reward.txt", "/app/f", "/logs/verifier/missing"], 1 << 20).files
    assert files == {"/logs/verifier/reward.txt": b"1\n", "/app/f": b"changed\n", "/logs/verifier/missing": None}
    assert box.close() is False  # finish closed it
    listed = requests.get(f"{host.address}/sandboxes", headers=headers, timeout=30).json()["sandboxes"]
    assert listed == []
    assert not images.joinpath("base", "app").exists()


def test_a_dead_hosts_writable_roots_leave_nothing_behind(node, images, monkeypatch):
    """A host SIGKILLed with writable-root sandboxes running: their processes go with it, no
    overlay is left in any mount table (each lived as the host's descriptor and in the sandbox's
    own namespace), and the next host on the root removes their layers with the workspaces."""
    import signal

    monkeypatch.setenv("PRORL_SANDBOX_IMAGE_DIRS", str(images))
    first, address, token = node.start_host("wr-a")
    headers = {"Authorization": f"Bearer {token}"}
    for i in range(2):
        reply = requests.post(f"{address}/sandboxes", headers=headers, timeout=60, json={
            "job_id": f"j{i}", "spec": {"runtime": "bwrap", "image": str(images / "base"), "writable_root": True}})
        sandbox_id = reply.json()["sandbox_id"]
        done = requests.post(f"{address}/sandboxes/{sandbox_id}/exec", headers=headers, timeout=60,
                             json={"command": "echo x > /changed; (sleep 1000 &); echo up", "timeout": 20})
        assert done.json()["output"] == "up\n"
    seen_by_host = Path(f"/proc/{first.pid}/root{node.root}/wr-a")  # its workspaces, in its own mount namespace
    assert len(list(seen_by_host.glob("bwrap-*/upper/changed"))) == 2
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    assert wait_until(lambda: not node.uid_processes(), 10)
    for pid in ("self", "1"):
        assert not [line for line in _mount_lines(pid) if str(node.root) in line and " - overlay " in line]
    node.start_host("wr-b")
    assert mounts_under(node.root / "wr-a") == []
    assert not (node.root / "wr-a").exists()


def test_a_warm_writable_root_is_claimed_and_survives_a_shell_restart(images, start_host):
    """A writable-root sandbox started ahead of demand is handed out only for a writable-root
    spec of its image, gets the job's working directory made in its root, and a restarted shell
    (a new bwrap, the overlay bound again from the host's descriptor) keeps the root's changes."""
    import psutil

    host = start_host(runtime="bwrap", warm=1, env={"PRORL_SANDBOX_IMAGE_DIRS": str(images)})
    spec = {"image": str(images / "base"), "writable_root": True}
    create(host, "job-cold", spec=spec)
    assert wait_until(lambda: len([p for p in psutil.Process(host.proc.pid).children(recursive=True)
                                   if p.name() == "bwrap"]) >= 4, 10)  # the cold one and a warm one
    asked_at = time.time()
    plain = create(host, "job-ro", spec={"image": str(images / "base")})  # not the warm one
    assert plain.exec("touch /x 2>/dev/null || echo read-only").output == "read-only\n"
    box = create(host, "job-warm", spec={**spec, "workdir": "/srv/task"})
    pid = next(e for e in requests.get(f"{host.address}/sandboxes", timeout=30,
                                       headers={"Authorization": f"Bearer {host.token}"}).json()["sandboxes"]
               if e["job_id"] == "job-warm")["pid"]
    assert psutil.Process(pid).create_time() < asked_at  # it was running before the ask
    assert box.exec("pwd; echo kept > /srv/task/f").output == "/srv/task\n"
    assert "new shell" in box.exec("kill -9 $$").output
    assert box.exec("cat /srv/task/f").output == "kept\n"
