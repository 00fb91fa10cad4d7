"""docker:// images on a bwrap node, for real: a loopback docker-registry serves an image this
session builds (Python and pytest in a root of their own); sandbox hosts pull it with skopeo and
umoci into their image cache and run bwrap sandboxes in it (tests/registry.py)."""
from __future__ import annotations

import json
import os
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest

from prorl_celery.errors import ImageNotFound, ImageTooLarge
from sandboxes.client import open_sandbox, request
from sandboxes.base import SandboxSpec
from sandboxes.runtimes.images.cache import ImageCache
from sandboxes.images import check_reference
from tests.conftest import submit, wait
from tests.registry import LocalRegistry, needs_registry_tools, push_layout, tar_layer, write_layout
from tests.sandboxes.conftest import needs_bwrap, wait_until
from tests.helpers import reachable_tmpdir

pytestmark = [needs_bwrap(), needs_registry_tools()]


@pytest.fixture
def cache_dir():
    """An image cache the sandbox uids can traverse to (pytest's tmp_path is 0700)."""
    yield from reachable_tmpdir("prorl-test-imgcache-")


def image_host(start_host, cache_dir: Path, **env: str):
    return start_host(runtimes="bwrap", env={"PRORL_SANDBOX_IMAGE_CACHE": str(cache_dir), **env})


def create(host, image: str, job_id: str = "job-img"):
    body = json.dumps({"job_id": job_id, "spec": {"runtime": "bwrap", "image": image}})
    return request("POST", host.address, host.token, "/sandboxes", 120, data=body).json()


def create_error(host, image: str) -> tuple[int, dict]:
    from prorl_celery.http import request as http_request

    body = json.dumps({"job_id": "job-bad", "spec": {"runtime": "bwrap", "image": image}})
    response = http_request("POST", host.address + "/sandboxes", data=body, timeout=120,
                    headers={"Authorization": f"Bearer {host.token}"})
    return response.status_code, response.json()["error"]


def run(host, entry: dict, command: str) -> dict:
    path = f"/sandboxes/{entry['sandbox_id']}/exec"
    return request("POST", host.address, host.token, path, 60,
                   data=json.dumps({"command": command, "timeout": 50})).json()


def evictable(lock: Path) -> bool:
    """Whether an eviction could take the image's lock (no sandbox holds it shared)."""
    import fcntl

    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def close(host, entry: dict) -> None:
    request("DELETE", host.address, host.token, f"/sandboxes/{entry['sandbox_id']}", 30)


def test_pytest_runs_in_the_image_and_the_cache_is_hit_the_second_time(
        start_host, cache_dir, registry, python_image):
    host = image_host(start_host, cache_dir)
    first = create(host, python_image)
    assert first["info"]["image_cache"] == "pulled"
    assert first["info"]["image_digest"].startswith("sha256:")
    out = run(host, first, "python3 -m pytest --version && cat /etc/image-marker && echo $IMAGE_FLAVOUR")
    assert out["exit_code"] == 0, out
    assert out["output"].startswith("pytest ") and "from the image\npython\n" in out["output"]
    if os.path.exists("/usr/bin/git"):  # the host's, not the image's
        assert run(host, first, "test ! -e /usr/bin/git")["exit_code"] == 0
    lock = cache_dir / "images" / f"{first['info']['image_digest'].split(':')[1]}.lock"
    assert not evictable(lock)  # the live sandbox holds its image
    close(host, first)
    assert wait_until(lambda: evictable(lock), 30)  # released once the sandbox is gone
    fetched, asked = registry.blob_fetches("prorl/python"), len(registry.requests())
    assert fetched >= 2  # config and layer

    second = create(host, python_image, "job-img-2")
    assert second["info"]["image_cache"] == "hit"
    assert second["info"]["image_digest"] == first["info"]["image_digest"]
    assert run(host, second, "python3 -m pytest --version")["exit_code"] == 0
    close(host, second)
    assert registry.blob_fetches("prorl/python") == fetched
    assert len(registry.requests()) == asked  # the tag's digest is known: no registry call at all

    other = image_host(start_host, cache_dir)  # a second host of the node shares the cache
    third = create(other, python_image, "job-img-3")
    assert third["info"]["image_cache"] == "hit" and registry.blob_fetches("prorl/python") == fetched
    close(other, third)


def test_digest_reference_and_concurrent_creates_share_one_pull(start_host, cache_dir, registry,
                                                               python_image):
    host = image_host(start_host, cache_dir, PRORL_SANDBOX_IMAGE_REFRESH_S="0")
    before = registry.blob_fetches("prorl/python")
    entries: list[dict] = []
    threads = [threading.Thread(target=lambda i=i: entries.append(create(host, python_image, f"j{i}")))
               for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(entries) == 3
    assert "pulled" in [entry["info"]["image_cache"] for entry in entries]
    layers = registry.blob_fetches("prorl/python") - before
    assert layers == 2, registry.requests("GET", "/blobs/")  # one pull: config + one layer
    digest = entries[0]["info"]["image_digest"]
    pinned = f"{python_image.rsplit(':', 1)[0]}@{digest}"
    entry = create(host, pinned, "j-pinned")
    assert entry["info"]["image_cache"] == "hit" and entry["info"]["image_digest"] == digest
    for entry in [*entries, entry]:
        close(host, entry)


def test_missing_tag_unreachable_and_disallowed_registries_fail_typed(start_host, cache_dir,
                                                                      registry, python_image,
                                                                      redis_client):
    from prorl_celery.ops.procs import free_port

    dead = f"127.0.0.1:{free_port()}"
    host = image_host(start_host, cache_dir, PRORL_SANDBOX_REGISTRIES=f"{registry.host},{dead}",
                      PRORL_SANDBOX_INSECURE_REGISTRIES=f"{registry.host},{dead}")
    status, error = create_error(host, registry.ref("prorl/python", "no-such-tag"))
    assert (status, error["type"], error["field"]) == (404, "image_not_found", "spec.image")
    status, error = create_error(host, registry.ref("prorl/nothing-here", "3"))
    assert (status, error["type"]) == (404, "image_not_found")
    started = time.monotonic()
    status, error = create_error(host, f"docker://{dead}/prorl/python:3")
    assert (status, error["type"], error["field"]) == (424, "image_unavailable", "spec.image")
    assert time.monotonic() - started < 30 and "connection refused" in error["message"]
    status, error = create_error(host, "docker://registry.example.org/prorl/python:3")
    assert (status, error["type"], error["field"]) == (403, "policy_denied", "spec.image")
    assert "PRORL_SANDBOX_REGISTRIES" in error["message"]
    assert not [path for _, path, _ in registry.requests() if "nothing" in path and "blobs" in path]
    spec = SandboxSpec(runtime="bwrap", image=registry.ref("prorl/python", "gone"))
    with pytest.raises(ImageNotFound) as caught:  # what init sees: the typed error, at once
        open_sandbox(redis_client, spec, "job-typed")
    assert caught.value.field == "spec.image"


def test_an_oci_layout_beneath_the_image_dirs_is_an_image_too(start_host, cache_dir, python_image):
    from sandboxes.safedirs import private_dir

    images = private_dir(os.environ["PRORL_SANDBOX_IMAGE_DIRS"], 0o755)
    layout = Path(tempfile.mkdtemp(prefix="layout-", dir=images))
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", python_image,
                    f"oci:{layout}:py"], check=True)
    host = image_host(start_host, cache_dir)
    try:
        entry = create(host, f"oci:{layout}:py")
        assert entry["info"]["image_cache"] == "pulled"
        assert run(host, entry, "cat /etc/image-marker")["output"] == "from the image\n"
        close(host, entry)
        status, error = create_error(host, f"oci:{layout}:no-such-tag")
        assert (status, error["type"]) == (404, "image_not_found"), error
    finally:
        subprocess.run(["rm", "-rf", str(layout)], check=False)




def test_whole_service_runs_a_job_in_the_image(stack, registry, python_image):
    instance = {"data_source": "shell", "sandbox": {"runtime": "bwrap", "image": python_image},
                "commands": ["python3 -m pytest --version", "cat /etc/image-marker"]}
    view = wait(stack.api_url, submit(stack.api_url, instance), 120)
    assert view["status"] == "completed", view
    result = view["result"]
    steps = result["steps"]
    assert steps[0]["exit_code"] == 0 and steps[0]["output"].startswith("pytest ")
    assert steps[1]["output"] == "from the image\n"
    assert result["sandbox"]["image"] == python_image
    assert result["sandbox"]["image_digest"].startswith("sha256:")
    missing = {**instance, "sandbox": {"runtime": "bwrap", "image": registry.ref("prorl/python", "nope")}}
    view = wait(stack.api_url, submit(stack.api_url, missing), 120)
    failed = view["result"]
    assert view["status"] == "failed" and failed["critical_error"] == "init", view
    assert failed["error"]["type"] == "image_not_found" and "nope" in failed["error"]["message"]


# -- the cache itself, in this process ---------------------------------------------------------
def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def push_files(registry: LocalRegistry, repository: str, files: dict[str, bytes]) -> str:
    """A one-layer image of ``files`` (no shell: for the cache, not for sandboxes)."""
    work = Path(tempfile.mkdtemp(prefix="prorl-test-layout-"))
    layer = tar_layer([_member(name, data) for name, data in files.items()])
    push_layout(write_layout(work / "layout", [layer]), "img", registry.ref(repository, "1"))
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return registry.ref(repository, "1")


def test_eviction_keeps_the_budget_and_never_an_image_in_use(cache_dir, registry):
    refs = [check_reference(push_files(registry, f"prorl/blob{i}", {"data": os.urandom(600 << 10)}))
            for i in range(3)]
    cache = ImageCache(cache_dir, budget_mb=1, pull_timeout_s=60, refresh_s=300)
    first = cache.acquire(refs[0])
    first.release()
    second = cache.acquire(refs[1])  # 2 x 600 KiB > 1 MiB: the unused first goes
    assert [meta["digest"] for meta in cache.images()] == [second.digest]
    assert not os.path.exists(first.rootfs) and os.path.exists(second.rootfs)
    third = cache.acquire(refs[2])  # the second is held (a live sandbox): over budget, kept
    assert sorted(meta["digest"] for meta in cache.images()) == sorted([second.digest, third.digest])
    assert (Path(second.rootfs) / "data").stat().st_size == 600 << 10
    second.release()
    third.release()
    assert cache.evict() == [second.digest]  # the least recently used of the two
    again = cache.acquire(refs[2])
    assert not again.pulled and cache.pulls == 3
    again.release()


def test_an_image_over_the_budget_is_refused_and_leaves_nothing(cache_dir, registry):
    cache = ImageCache(cache_dir, budget_mb=1, pull_timeout_s=60, refresh_s=300)
    big = check_reference(push_files(registry, "prorl/big", {"data": os.urandom(2 << 20)}))
    before = registry.blob_fetches("prorl/big")
    with pytest.raises(ImageTooLarge, match="MiB of layers"):  # told by the manifest: no blob fetched
        cache.acquire(big)
    assert registry.blob_fetches("prorl/big") == before
    bomb = check_reference(push_files(registry, "prorl/zeros", {"data": bytes(8 << 20)}))
    with pytest.raises(ImageTooLarge, match="unpacks to"):  # small compressed, large unpacked
        cache.acquire(bomb)
    assert cache.images() == [] and not [p for p in (cache_dir / "images").iterdir() if p.is_dir()]


def test_a_registry_that_never_answers_fails_the_pull_in_time(cache_dir):
    import socket

    from prorl_celery.errors import ImageUnavailable
    from sandboxes.images import parse_docker

    with socket.socket() as silent:  # accepts connections (backlog) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        ref = parse_docker(f"docker://127.0.0.1:{silent.getsockname()[1]}/prorl/python:3")
        cache = ImageCache(cache_dir, 1024, pull_timeout_s=3, refresh_s=300)
        started = time.monotonic()
        with pytest.raises(ImageUnavailable, match="did not finish in time"):
            cache.acquire(ref)
        assert time.monotonic() - started < 10


def test_a_known_tag_survives_its_registry_going_away(cache_dir, monkeypatch):
    from config.settings import get_settings
    from prorl_celery.ops.procs import free_port

    work = Path(tempfile.mkdtemp(prefix="prorl-test-registry2-"))
    second = LocalRegistry(work, free_port())
    monkeypatch.setenv("PRORL_SANDBOX_INSECURE_REGISTRIES", second.host)
    get_settings.cache_clear()
    try:
        ref = check_reference_unlisted(push_files(second, "prorl/kept", {"data": b"kept"}))
        cache = ImageCache(cache_dir, 1024, pull_timeout_s=30, refresh_s=0)  # ask on every create
        cache.acquire(ref).release()
        second.stop()
        again = cache.acquire(ref)  # the registry is gone: the last digest known is used
        assert not again.pulled and (Path(again.rootfs) / "data").read_bytes() == b"kept"
        again.release()
    finally:
        if second.proc.poll() is None:
            second.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)
        monkeypatch.undo()
        get_settings.cache_clear()


def check_reference_unlisted(image: str):
    """The parsed reference without the allow-list (the cache itself never judges policy)."""
    from sandboxes.images import parse_docker

    return parse_docker(image)
