"""Issue 10 rows 2, 5, 7, 8 and 9 (policy part): the operator's policy, not the request's.

Attacks run for real: a sandbox host process started without ``local`` (its token read from
Redis, as an attacker inside would), the whole stack over HTTP, real bwrap sandboxes, real git.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest
import requests

from prorl_celery import keys
from prorl_celery.errors import PolicyDenied, SandboxError
from sandboxes.base import Limits
from prorl_celery.fakes import swe
from tests.conftest import REDIS_PORT, submit, wait
from tests.rootfs import build_rootfs
from tests.sandboxes.conftest import (REPO, needs_bwrap, sandbox_redis, sandbox_root,  # noqa: F401
                                      start_host)

pytestmark = needs_bwrap()
NO_LOCAL = {"PRORL_ALLOW_LOCAL_RUNTIME": None}
IMAGES = Path(f"/tmp/prorl-test-images-{REDIS_PORT}")  # the stack's PRORL_SANDBOX_IMAGE_DIRS


def _token_from_redis(client, host_id: str) -> str:
    """What an attacker who reached Redis gets: the host's bearer token from its record."""
    return client.hget(keys.host(host_id), "token").decode()


def _post(address: str, token: str, spec: dict, job_id: str = "attack") -> requests.Response:
    return requests.post(f"{address}/sandboxes", json={"job_id": job_id, "spec": spec},
                         headers={"Authorization": f"Bearer {token}"}, timeout=30)


# -- rows 2 and 5: runtimes ---------------------------------------------------------------------
def test_host_token_cannot_create_local_by_any_name(start_host, sandbox_redis, tmp_path):
    import redis

    redis_client = redis.Redis.from_url(sandbox_redis)
    host = start_host(env=NO_LOCAL)
    token = _token_from_redis(redis_client, host.host_id)
    assert json.loads(redis_client.hget(keys.host(host.host_id), "runtimes")) == ["bwrap"]
    proof = Path(tempfile.gettempdir()) / f"prorl-proof-{uuid.uuid4().hex}"
    for runtime in ("local", "sandboxes.runtimes.local:LocalSandbox", "sandboxes.runtimes.local.LocalSandbox"):
        response = _post(host.address, token, {"runtime": runtime})
        assert response.status_code == 403, (runtime, response.text)
        error = response.json()["error"]
        assert error["type"] == "policy_denied" and error["field"] == "spec.runtime"
        assert "PRORL_ALLOW_LOCAL_RUNTIME" in error["message"]
        created = response.json().get("sandbox_id")  # there is none: nothing to run the command in
        if created:
            requests.post(f"{host.address}/sandboxes/{created}/exec", json={"command": f"touch {proof}"},
                          headers={"Authorization": f"Bearer {token}"}, timeout=30)
    listed = requests.get(f"{host.address}/sandboxes", headers={"Authorization": f"Bearer {token}"},
                          timeout=10).json()["sandboxes"]
    assert listed == [] and not proof.exists()
    served = _post(host.address, token, {"runtime": "sandboxes.runtimes.bwrap:BwrapSandbox"})  # a served class
    assert served.status_code == 201 and served.json()["runtime"] == "bwrap"
    assert served.json()["info"]["isolation"] == "namespaces"


def test_a_host_started_for_local_without_the_operator_refuses_to_start(sandbox_redis):
    env = {k: v for k, v in os.environ.items() if k != "PRORL_ALLOW_LOCAL_RUNTIME"}
    done = subprocess.run([sys.executable, "-m", "sandboxes.host.main", "--no-register", "--runtimes", "local"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "PRORL_ALLOW_LOCAL_RUNTIME" in done.stderr
    assert "sandbox-host ready" not in done.stdout


def test_auto_without_working_bwrap_fails_closed(start_host, sandbox_redis, tmp_path):
    missing = {"bwrap": {"bwrap": str(tmp_path / "no-such-bwrap")}}
    env = {k: v for k, v in os.environ.items() if k != "PRORL_ALLOW_LOCAL_RUNTIME"}
    done = subprocess.run([sys.executable, "-m", "sandboxes.host.main", "--no-register",
                           "--runtime-config", json.dumps(missing)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stdout  # nothing to serve: no silent 'local'
    assert "scripts/install-system-deps.sh" in done.stderr and "PRORL_ALLOW_LOCAL_RUNTIME=1" in done.stderr
    host = start_host(env=NO_LOCAL, runtimes="bwrap", runtime_config=missing)
    for runtime in ("auto", None):  # None: the default runtime, which is auto
        response = _post(host.address, host.token, {"runtime": runtime} if runtime else {})
        assert response.status_code >= 400, response.text
        message = response.json()["error"]["message"]
        assert "install-system-deps.sh" in message and "PRORL_ALLOW_LOCAL_RUNTIME=1" in message
    assert _post(host.address, host.token, {"runtime": "local"}).status_code == 403
    assert requests.get(f"{host.address}/health", timeout=10).json()["auto"] is None


# -- row 8: images ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image_dir():
    """The stack's image directory with one real rootfs image and one link out of it."""
    IMAGES.mkdir(mode=0o755, exist_ok=True)
    (IMAGES / "mini").mkdir(exist_ok=True)
    if not (IMAGES / "mini" / "etc").exists():
        build_rootfs(IMAGES / "mini")
    os.chmod(IMAGES / "mini", 0o755)
    if not (IMAGES / "escape").is_symlink():
        os.symlink("/", IMAGES / "escape")
    yield IMAGES
    shutil.rmtree(IMAGES, ignore_errors=True)


def _shell(*commands: str, **sandbox) -> dict:
    return {"data_source": "shell", "commands": list(commands), "sandbox": {"runtime": "bwrap", **sandbox}}


def test_image_must_be_a_registered_one(api, image_dir, redis_client):
    for image in ("/", "/etc", f"{image_dir}/../../etc", "..", "mini/../../etc"):
        response = requests.post(f"{api}/jobs", json={"instance": _shell("ls /home", image=image)}, timeout=10)
        assert response.status_code == 403, (image, response.text)  # as the host says it
        assert response.json()["error"]["field"] == "instance.sandbox.image", response.json()
    # a link out of the image directory passes the API (it cannot resolve another node's links)
    # and is refused by the host, which does: the job fails with the reason, nothing listed
    escaped = wait(api, submit(api, _shell("ls /work /home /run", image=str(image_dir / "escape"))))
    result = escaped["result"]
    assert escaped["status"] == "failed" and result["error"]["type"] == "policy_denied"
    assert "not beneath a registered image directory" in result["error"]["message"]
    assert "steps" not in result or result["steps"] == []
    ok = wait(api, submit(api, _shell("cat /etc/image-marker", "ls /work 2>&1 || echo no-work", image="mini")))
    assert ok["status"] == "completed", ok["result"]["error"]
    assert [s["output"] for s in ok["result"]["steps"]][0] == "from the image\n"
    assert ok["result"]["steps"][1]["output"].endswith("no-work\n")
    assert ok["result"]["sandbox"]["image"] == str(image_dir / "mini")


def test_the_host_refuses_an_unregistered_image_to_its_own_token(stack, redis_client, image_dir):
    host_id = next(h.decode() for h in redis_client.zrange(keys.hosts(), 0, -1))
    record = {k.decode(): v.decode() for k, v in redis_client.hgetall(keys.host(host_id)).items()}
    for image in ("/", str(image_dir / "escape"), "/etc"):
        response = _post(record["address"], record["token"], {"runtime": "bwrap", "image": image})
        assert response.status_code == 403, response.text
        assert response.json()["error"]["field"] == "spec.image"


# -- row 9: limits ------------------------------------------------------------------------------
def test_limits_can_be_lowered_not_lifted_or_dropped(api):
    asked = {"nofile": 10**6, "cpu_s": 10**7, "nproc": None, "memory_mb": 10**6}
    lifted = wait(api, submit(api, _shell("ulimit -n", "ulimit -t", "ulimit -u", limits=asked)))
    assert lifted["status"] == "completed", lifted
    nofile, cpu, nproc = (s["output"].strip() for s in lifted["result"]["steps"])
    assert nofile == str(Limits().nofile)  # the default, not the 10**6 asked for
    assert cpu == "3600"  # the operator's ceiling (no default): not 10**7, not unlimited
    assert nproc == "1024"  # null kept the limit: the ceiling, not unlimited
    applied = lifted["result"]["sandbox"]["limits"]
    assert applied["nofile"] == Limits().nofile and applied["memory_mb"] <= 8192
    lowered = wait(api, submit(api, _shell("ulimit -n", limits={"nofile": 100})))
    assert lowered["result"]["steps"][0]["output"].strip() == "100"


def test_the_host_clamps_limits_to_the_ceilings(start_host):
    host = start_host(env={"PRORL_SANDBOX_MAX_LIMITS": json.dumps({"nofile": 256, "nproc": 50})})
    response = _post(host.address, host.token, {"runtime": "bwrap", "limits": {"nofile": 10**6, "nproc": None}})
    assert response.status_code == 201, response.text
    entry = response.json()
    out = requests.post(f"{host.address}/sandboxes/{entry['sandbox_id']}/exec",
                        json={"command": "ulimit -n; ulimit -u"},
                        headers={"Authorization": f"Bearer {host.token}"}, timeout=30).json()["output"]
    assert out.split() == ["256", "50"]
    assert entry["info"]["limits"]["nofile"] == 256


# -- row 7: repo_source -------------------------------------------------------------------------
@pytest.fixture
def secret_repo():
    """A root-only git repository outside every allowed directory."""
    path = Path(tempfile.mkdtemp(prefix="prorl-secret-repo-"))  # 0700, owned by root
    marker = f"TOP-SECRET-{uuid.uuid4().hex}"
    (path / "secret.txt").write_text(marker)
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    yield path, marker
    shutil.rmtree(path, ignore_errors=True)


def test_repo_source_outside_the_allowed_dirs_is_refused(api, tmp_path, secret_repo):
    path, marker = secret_repo
    instance = swe.build("statkit", tmp_path / "repos")
    for source in (f"file://{path}", str(path), "/root/secret", "http://example.com/x.git",
                   "ext::sh -c touch% /tmp/pwned", "git@github.com:a/b.git", "--upload-pack=touch /tmp/x",
                   "ssh://example.com/x.git"):
        response = requests.post(f"{api}/jobs", json={"instance": {**instance, "repo_source": source}}, timeout=10)
        assert response.status_code == 403, (source, response.text)
        assert response.json()["error"]["field"] == "instance.repo_source"
    # a link beneath an allowed directory that points at the secret passes the API's lexical
    # check; the worker resolves it and refuses: the secret never reaches a sandbox
    link = tmp_path / "repos" / "innocent"
    os.symlink(path, link)
    view = wait(api, submit(api, {**instance, "repo_source": str(link)}), timeout=90)
    assert view["status"] == "failed" and view["result"]["error"]["type"] == "policy_denied"
    assert marker not in json.dumps(view)


def test_https_clone_runs_unprivileged_with_protocols_restricted(tmp_path, monkeypatch):
    """A stand-in ``git`` (first on PATH) reports the uid and argv it was started with."""
    from tasks.swe import repo

    bindir = Path(tempfile.mkdtemp(prefix="prorl-fake-git-"))
    try:
        os.chmod(bindir, 0o755)
        fake = bindir / "git"
        fake.write_text('#!/bin/sh\necho "uid=$(id -u) home=$HOME argv: $*" >&2\nexit 128\n')
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
        with pytest.raises(SandboxError) as caught:
            repo.clone("https://example.invalid/owner/repo.git", tmp_path / "target")
    finally:
        shutil.rmtree(bindir, ignore_errors=True)
    message = str(caught.value)
    assert "uid=65534 " in message  # not root
    assert "argv: -c protocol.allow=never -c protocol.https.allow=always" in message
    assert "clone --mirror --quiet -- https://example.invalid/owner/repo.git" in message
    assert not (tmp_path / "target").exists()


def test_real_git_reaches_an_https_url_and_nothing_else(tmp_path):
    """Real git, as nobody: an https URL gets as far as a TLS handshake with a local listener
    (no internet needed); the same listener behind http:// or ext:: is never contacted."""
    from tasks.swe import repo

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    first_bytes: list[bytes] = []

    def accept() -> None:
        listener.settimeout(20)
        try:
            conn, _ = listener.accept()
            first_bytes.append(conn.recv(3))
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    for refused in (f"http://127.0.0.1:{port}/x.git", f"ext::nc 127.0.0.1 {port}"):
        with pytest.raises(PolicyDenied):
            repo.local_repo({"repo_source": refused, "repo": "x/y"})
    with pytest.raises(SandboxError, match="could not clone"):
        repo.clone(f"https://127.0.0.1:{port}/x.git", tmp_path / "target")
    thread.join(25)
    listener.close()
    assert first_bytes and first_bytes[0][:1] == b"\x16"  # a TLS ClientHello: https it was


# -- row 5: results and /healthz say what ran ---------------------------------------------------
def test_results_and_healthz_say_which_runtime_ran(api):
    bwrap = wait(api, submit(api, _shell("true")))
    assert bwrap["result"]["sandbox"]["runtime"] == "bwrap"
    assert bwrap["result"]["sandbox"]["isolation"] == "namespaces"
    assert bwrap["result"]["sandbox"]["network"] == "none"
    local = wait(api, submit(api, {"data_source": "shell", "commands": ["true"], "sandbox": {"runtime": "local"}}))
    assert (local["result"]["sandbox"]["runtime"], local["result"]["sandbox"]["isolation"]) == ("local", "none")
    hosts = requests.get(f"{api}/healthz", timeout=10).json()["sandbox_hosts"]
    assert hosts and all("token" not in host for host in hosts)
    host = hosts[0]
    assert {"bwrap", "local"} <= set(host["runtimes"]) and host["auto"] == "bwrap"
    assert host["isolation"]["bwrap"] == "namespaces" and host["isolation"]["local"] == "none"
    assert isinstance(host["limit_enforcement"], dict)


# -- the pure policy, without processes ---------------------------------------------------------
@pytest.mark.unit
def test_merge_is_field_by_field_and_only_lowers():
    from sandboxes.policy import merge_limits
    from tasks.swe.handler import SweHandler

    defaults = SweHandler.default_sandbox["limits"]
    merged = merge_limits(defaults, {"memory_mb": 10**6, "nproc": None, "fsize_mb": 10}, caps={"nproc": 100})
    assert merged.memory_mb == defaults["memory_mb"]  # clamped to the handler's default
    assert merged.nproc == 100  # null kept the default (256), then the ceiling clamped it
    assert merged.fsize_mb == 10  # lowered: allowed
    assert merged.pids == Limits().pids  # a field neither names keeps Limits' own default
    spec = SweHandler().sandbox_spec({"sandbox": {"limits": {"memory_mb": 64}}})
    assert spec.limits.memory_mb == 64 and spec.limits.nproc == defaults["nproc"]
