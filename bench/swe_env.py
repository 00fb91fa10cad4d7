"""Environment setup cost of a SWE instance, side by side in one run.

Image part (issue 12 item 1; the checkout part belongs to the SWE engineers and is added beside
it): the time from ``POST /sandboxes`` to a bwrap sandbox whose shell answers, through a real
sandbox host over HTTP, in a ``docker://`` image served by a loopback ``docker-registry``
(Python + pytest, built by ``tests/registry.py``):

- cold: the image is not in the host's cache (pull with skopeo, unpack with umoci, sanitize);
- warm: the image is cached (its tag's digest known: no registry call);
- dir: the same rootfs as a plain image directory beneath ``PRORL_SANDBOX_IMAGE_DIRS`` (what
  an image cost before this work: the floor a cached image should meet).

Also the bytes fetched from the registry per create (cold: the image's blobs; warm: none).

Checkout part (issue 12 item 4): a commit of a local repository into a fresh sandbox on the same
kind of host, the old way (a tar of a full clone, history and all, unpacked and checked out in the
sandbox) beside the new one cold (the commit packed alone) and warm (its pack cached); the
checkout's time (the create excluded) and the bytes written into the sandbox, which every init
and every eval pays once each.

    python bench/swe_env.py [--runs 10] [--part images|checkout|all] [--repo PATH --commit SHA]

Checkout line: ``checkout_old_p50_ms=<> checkout_cold_p50_ms=<> checkout_warm_p50_ms=<>
old_over_warm=<> old_bytes=<> pack_bytes=<> bytes_ratio=<>``.

Last line: ``image_cold_p50_ms=<> image_warm_p50_ms=<> image_dir_p50_ms=<> cold_over_warm=<>
warm_over_dir=<> cold_bytes=<> warm_bytes=<>``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prorl_celery.ops.procs import free_port  # noqa: E402
from sandboxes.client import request  # noqa: E402
from tests.registry import LocalRegistry, build_python_rootfs, missing_tools, push_dir  # noqa: E402


def start_host(cache: Path, images: Path, registry: str, root: Path) -> tuple[subprocess.Popen, str, str]:
    token = "bench-token"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PRORL_SANDBOX_REGISTRIES": registry,
           "PRORL_SANDBOX_INSECURE_REGISTRIES": registry, "PRORL_SANDBOX_IMAGE_CACHE": str(cache),
           "PRORL_SANDBOX_IMAGE_DIRS": str(images)}
    argv = [sys.executable, "-m", "sandboxes.host.main", "--no-register", "--runtimes", "bwrap",
            "--token", token, "--warm", "0", "--log-level", "WARNING",
            "--runtime-config", json.dumps({"bwrap": {"root": str(root)}})]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if not line.startswith("sandbox-host ready"):
        raise SystemExit(f"sandbox host did not start: {line}")
    return proc, line.split()[-1], token


def create_ms(address: str, token: str, image: str) -> tuple[float, dict]:
    """ms until the new sandbox's shell answered ``true``; the sandbox is closed after."""
    started = time.perf_counter()
    entry = request("POST", address, token, "/sandboxes", 300, data=json.dumps(
        {"job_id": "bench", "spec": {"runtime": "bwrap", "image": image}})).json()
    path = f"/sandboxes/{entry['sandbox_id']}"
    out = request("POST", address, token, f"{path}/exec", 60,
                  data=json.dumps({"command": "true", "timeout": 30})).json()
    elapsed = (time.perf_counter() - started) * 1000
    request("DELETE", address, token, path, 30)
    if out["exit_code"] != 0:
        raise SystemExit(f"the sandbox's shell failed: {out}")
    return elapsed, entry["info"]


def forget_images(cache: Path) -> None:
    """Make the next create a cold pull: the cached rootfs and the tag's digest removed."""
    for sub in ("images", "refs"):
        if not (cache / sub).is_dir():  # the host makes its cache on the first image
            continue
        for path in (cache / sub).iterdir():
            if path.is_dir():
                subprocess.run(["rm", "-rf", str(path)], check=True)
            elif path.suffix == ".json":
                path.unlink()


def blob_bytes(registry: LocalRegistry, repository: str, since: int) -> int:
    """Bytes of the blobs the registry served after the ``since``-th request (from its store)."""
    total = 0
    for method, path, status in registry.requests()[since:]:
        if method == "GET" and status == 200 and f"/v2/{repository}/blobs/sha256:" in path:
            digest = path.rsplit(":", 1)[1]
            data = registry.work / "store" / "docker" / "registry" / "v2" / "blobs" / "sha256" / digest[:2] / digest / "data"
            total += data.stat().st_size
    return total


def bench_images(runs: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="prorl-bench-images-"))
    os.chmod(work, 0o711)
    registry = LocalRegistry(work, free_port())
    try:
        images = work / "images"
        rootfs = images / "python-dir"
        rootfs.mkdir(parents=True)
        build_python_rootfs(rootfs)
        subprocess.run(["chmod", "-R", "go+rX", str(images)], check=True)
        ref = registry.ref("bench/python", "3")
        push_dir(rootfs, ref, work)
        cache, root = work / "cache", work / "sandboxes"
        root.mkdir(mode=0o711)
        proc, address, token = start_host(cache, images, registry.host, root)
        try:
            create_ms(address, token, str(rootfs))  # the host's first sandbox pays imports
            rows: dict[str, list[float]] = {"cold": [], "warm": [], "dir": []}
            moved: dict[str, list[int]] = {"cold": [], "warm": []}
            for _ in range(runs):
                forget_images(cache)
                for kind in ("cold", "warm"):
                    since = len(registry.requests())
                    ms, info = create_ms(address, token, ref)
                    assert info["image_cache"] == ("pulled" if kind == "cold" else "hit"), info
                    rows[kind].append(ms)
                    moved[kind].append(blob_bytes(registry, "bench/python", since))
                rows["dir"].append(create_ms(address, token, str(rootfs))[0])
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        registry.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)
    p50 = {kind: statistics.median(values) for kind, values in rows.items()}
    return {"runs": runs, "p50_ms": p50, "all_ms": rows,
            "cold_bytes": statistics.median(moved["cold"]), "warm_bytes": max(moved["warm"])}


# -- checkout part (issue 12 item 4) --------------------------------------------------------
def _remote(address: str, token: str):
    from sandboxes.base import SandboxHandle
    from sandboxes.client import RemoteSandbox
    from sandboxes.protocol import SandboxEntry

    entry = SandboxEntry.model_validate(request("POST", address, token, "/sandboxes", 300, data=json.dumps(
        {"job_id": "bench-checkout", "spec": {"runtime": "bwrap"}})).json())
    handle = SandboxHandle(host_id=entry.host_id, address=address, token=token,
                           sandbox_id=entry.sandbox_id, runtime=entry.runtime)
    return RemoteSandbox(handle, entry)


def _old_checkout(box, work: Path, commit: str) -> int:
    """The checkout before this work: the whole repository (work tree and all history) as a tar,
    unpacked and checked out in the sandbox. Returns the bytes written into the sandbox."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(str(work), arcname=".")
    data = buffer.getvalue()
    box.write_file("repo.tar", data)
    out = box.exec(f"mkdir -p repo && tar -xf repo.tar -C repo && rm -f repo.tar && cd repo && "
                   f"git -c advice.detachedHead=false checkout -q -f {commit} && git clean -qfdx && cd ..",
                   timeout=600)
    if out.exit_code != 0:
        raise SystemExit(f"the old checkout failed: {out.output[-500:]}")
    return len(data)


def bench_checkout(runs: int, source: Path, commit: str) -> dict:
    """Checkout of ``commit`` of the repository at ``source`` into a fresh sandbox on a real host
    over HTTP: the old way (tar of a full clone), cold (mirror read, commit packed) and warm (pack
    cached); the time of the checkout alone (sandbox create excluded) and the bytes written."""
    from tasks.swe import repo

    work = Path(tempfile.mkdtemp(prefix="prorl-bench-checkout-"))
    os.chmod(work, 0o711)
    os.environ["PRORL_REPO_CACHE"] = str(work / "cache")
    from config.settings import get_settings

    get_settings.cache_clear()
    clone = work / "clone"  # a full clone with its work tree: what the old code cached and packed
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(source), str(clone)], check=True)
    instance = {"repo": "bench/repo", "repo_source": str(source), "base_commit": commit}
    root = work / "sandboxes"
    root.mkdir(mode=0o711)
    (work / "images").mkdir()
    proc, address, token = start_host(work / "image-cache", work / "images", "", root)
    rows: dict[str, list[float]] = {"old": [], "cold": [], "warm": []}
    moved: dict[str, int] = {}
    try:
        for _ in range(runs):
            for kind in ("old", "cold", "warm"):
                if kind == "cold":
                    subprocess.run(["rm", "-rf", str(work / "cache" / "packs")], check=True)
                box = _remote(address, token)
                try:
                    started = time.perf_counter()
                    if kind == "old":
                        moved["old"] = _old_checkout(box, clone, commit)
                    else:
                        repo.checkout_into(box, instance, "repo")
                        moved[kind] = repo.pack_bytes(instance)
                    rows[kind].append((time.perf_counter() - started) * 1000)
                finally:
                    box.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        subprocess.run(["rm", "-rf", str(work)], check=False)
    files = subprocess.run(["git", f"--git-dir={repo.git_dir_of(source)}", "ls-tree", "-r", "--name-only", commit],
                           capture_output=True, text=True, check=True).stdout.count("\n")
    return {"runs": runs, "files": files, "p50_ms": {k: statistics.median(v) for k, v in rows.items()},
            "all_ms": rows, "bytes": moved}


def checkout_line(result: dict) -> str:
    p50, moved = result["p50_ms"], result["bytes"]
    return (f"checkout_old_p50_ms={p50['old']:.0f} checkout_cold_p50_ms={p50['cold']:.0f} "
            f"checkout_warm_p50_ms={p50['warm']:.0f} old_over_warm={p50['old'] / p50['warm']:.1f} "
            f"old_bytes={moved['old']} pack_bytes={moved['warm']} bytes_ratio={moved['old'] / moved['warm']:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--part", choices=("images", "checkout", "all"), default="all")
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout part: a local git repository "
                        "(work tree or bare); default: this project's own")
    parser.add_argument("--commit", default="HEAD", help="checkout part: the commit to check out")
    args = parser.parse_args()
    if args.part in ("checkout", "all"):
        if not shutil.which("bwrap"):
            raise SystemExit("missing: bwrap (scripts/install-system-deps.sh)")
        source = args.repo.resolve()
        os.environ["PRORL_REPO_SOURCE_DIRS"] = str(source.parent)
        commit = subprocess.run(["git", f"--git-dir={_git_dir(source)}", "rev-parse", args.commit],
                                capture_output=True, text=True, check=True).stdout.strip()
        checkout = bench_checkout(args.runs, source, commit)
        print(json.dumps(checkout, indent=1))
        print(checkout_line(checkout))
    if args.part == "checkout":
        return
    missing = missing_tools()
    if missing or not shutil.which("bwrap"):
        raise SystemExit(f"missing: {missing or ['bwrap']} (scripts/install-system-deps.sh)")
    result = bench_images(args.runs)
    print(json.dumps(result, indent=1))
    p50 = result["p50_ms"]
    print(f"image_cold_p50_ms={p50['cold']:.0f} image_warm_p50_ms={p50['warm']:.0f} "
          f"image_dir_p50_ms={p50['dir']:.0f} cold_over_warm={p50['cold'] / p50['warm']:.1f} "
          f"warm_over_dir={p50['warm'] / p50['dir']:.2f} cold_bytes={result['cold_bytes']:.0f} "
          f"warm_bytes={result['warm_bytes']}")


def _git_dir(path: Path) -> Path:
    return path / ".git" if (path / ".git").is_dir() else path


if __name__ == "__main__":
    main()
