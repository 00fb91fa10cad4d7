"""The singularity runtime on a real Apptainer (``-m apptainer``).

``scripts/install-apptainer.sh`` installs Debian sid's apptainer into a private prefix (the tests
skip, saying why, when it cannot); the image is a SIF that apptainer builds here from a rootfs of
the host's own tools, Python and git (cached under ~/.cache/prorl-celery/test-images by its
content). The contract every runtime passes runs on it, in this process and through a sandbox
host; then what only this runtime does (uids, cgroup limits, nothing left after close, the
environment policy, a host killed with -9), and a SWE fixture resolving through the whole
service in that SIF.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandboxes.base import Limits, SandboxSpec
from tests.rootfs import IMAGE_TOOLS, build_rootfs
from tests.sandboxes.test_contract import SPEC, test_contract, test_contract_isolation
from tests.sandboxes.test_host import create

CONTRACT = (test_contract, test_contract_isolation)  # collected here, on this module's box

pytestmark = pytest.mark.apptainer
REPO = Path(__file__).resolve().parents[2]
IMAGES = Path(os.path.expanduser("~/.cache/prorl-celery/test-images"))
TOOLS = IMAGE_TOOLS + ("touch", "ln", "seq", "wc", "grep", "pgrep", "basename", "dirname", "tar",
                       "git", "sed", "head", "tail", "chmod", "find", "sort", "tr", "cut", "ps",
                       "kill", "xargs", "diff", "pwd", "uname", "setsid")
PYTHON = "/usr/bin/python3.11"
_SKIP_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
                "__pycache__", "config-3.11-x86_64-linux-gnu", "dist-packages", "site-packages"}
IMAGE_VERSION = "1"  # bump when the image's recipe changes


@pytest.fixture(scope="session")
def apptainer_bin() -> str:
    """The installed binary (the script is idempotent: a second run only checks it)."""
    done = subprocess.run([str(REPO / "scripts" / "install-apptainer.sh")], capture_output=True,
                          text=True, timeout=900)
    path = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not os.access(path, os.X_OK):
        pytest.skip(f"scripts/install-apptainer.sh could not install apptainer: {done.stderr[-800:]}")
    os.environ["PRORL_APPTAINER_BIN"] = path
    from config.settings import get_settings

    get_settings.cache_clear()
    return path


def _copy_with_libs(files: list[str], root: Path) -> None:
    """``files`` and the libraries ldd finds for them, at their own paths under ``root``."""
    wanted = set(files)
    for path in files:
        out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
        wanted.update(part for line in out.splitlines() for part in line.split() if part.startswith("/"))
    for path in sorted(wanted):
        target = root / path.lstrip("/")
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(path), target)


def build_image_rootfs(root: Path) -> None:
    """The test image: tests/rootfs.py's tools plus a few more, Python with its standard
    library, git, and the mount points and files apptainer fills in."""
    build_rootfs(root, TOOLS)
    stdlib = Path(PYTHON.replace("/bin/", "/lib/"))  # /usr/lib/python3.11
    shutil.copytree(stdlib, root / str(stdlib).lstrip("/"), symlinks=True, dirs_exist_ok=True,
                    ignore=lambda d, names: [n for n in names if n in _SKIP_STDLIB])
    dynload = [str(p) for p in (stdlib / "lib-dynload").glob("*.so")]
    _copy_with_libs([PYTHON, *dynload], root)
    (root / "usr/bin/python3").unlink(missing_ok=True)
    os.symlink("python3.11", root / "usr/bin/python3")
    for name in ("dev", "proc", "sys", "tmp", "var/tmp", "home", "workspace", "root", "etc"):
        (root / name).mkdir(parents=True, exist_ok=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc/group").write_text("root:x:0:\n")
    for name in ("hosts", "resolv.conf"):
        (root / "etc" / name).touch()


def image_key() -> str:
    recipe = "\n".join([IMAGE_VERSION, PYTHON, *TOOLS, sys.version])
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


@pytest.fixture(scope="session")
def sif_image(apptainer_bin, tmp_path_factory) -> str:
    """A SIF built by apptainer from :func:`build_image_rootfs`, once per recipe."""
    if not os.path.exists(PYTHON):
        pytest.skip(f"the test image copies the host's {PYTHON}, which is missing")
    IMAGES.mkdir(parents=True, exist_ok=True)
    sif = IMAGES / f"python-git-{image_key()}.sif"
    if not sif.exists():
        rootfs = tmp_path_factory.mktemp("sif-rootfs")
        build_image_rootfs(rootfs)
        build_sif(apptainer_bin, rootfs, sif)
    return str(sif)


def build_sif(apptainer_bin: str, source: Path, sif: Path) -> None:
    """``apptainer build`` of a directory into ``sif`` (written aside, then renamed)."""
    partial = sif.with_suffix(f".{os.getpid()}.part")
    done = subprocess.run([apptainer_bin, "--quiet", "build", "--force", "--mksquashfs-args",
                           "-comp gzip -Xcompression-level 1", str(partial), str(source)],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    os.replace(partial, sif)


def open_box(sif_image: str, root: Path, spec: SandboxSpec | None = None, job: str = "apptainer-job"):
    from sandboxes.runtimes.singularity import SingularitySandbox

    spec = (spec or SPEC).model_copy(update={"image": sif_image})
    return SingularitySandbox(spec, job, {"root": str(root)})


@pytest.fixture(params=["singularity", "remote"])
def box(request, sif_image, sandbox_root):
    """What test_contract's tests (imported above) run on: the real runtime, in this process
    and served by a sandbox host over HTTP."""
    if request.param == "remote":
        host = request.getfixturevalue("start_host")(
            runtimes="singularity", runtime_config={"singularity": {"root": str(sandbox_root)}},
            env={"PRORL_APPTAINER_BIN": os.environ["PRORL_APPTAINER_BIN"],
                 "PRORL_SANDBOX_IMAGE_DIRS": str(IMAGES)})
        sandbox = create(host, "contract-job", spec={**SPEC.model_dump(), "runtime": "singularity",
                                                     "image": sif_image})
    else:
        sandbox = open_box(sif_image, sandbox_root)
    sandbox.kind = request.param
    yield sandbox
    sandbox.close()


# -- what only this runtime does ---------------------------------------------------------------
def _cgroup_dir(pid: int, controller: str) -> Path | None:
    """The cgroup v1 directory of ``pid`` for ``controller`` (None where there is none)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return Path("/sys/fs/cgroup") / controller / path.lstrip("/")
    return None


def _stat(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return f"{pid} gone"


def _uid_processes(uid: int, wait_s: float = 5.0) -> list[int]:
    """Live (not zombie) processes of ``uid``, after up to ``wait_s`` for them to go (a
    SIGKILL'd namespace empties within moments, not at once)."""
    from sandboxes.runtimes.procs import alive

    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.stat(f"/proc/{name}").st_uid == uid and alive(int(name)):
                    found.append(int(name))
            except OSError:
                pass
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def test_runs_as_its_own_uid_without_capabilities(sif_image, sandbox_root):
    if os.geteuid() != 0:
        pytest.skip("a uid per sandbox is for a sandbox host running as root")
    box = open_box(sif_image, sandbox_root)
    try:
        uid = box.info()["uid"]
        assert uid >= 1_000_000 and box.exec("id -u").output == f"{uid}\n"
        assert box.exec("grep CapEff /proc/self/status").output.split() == ["CapEff:", "0" * 16]
        # host uid 0 without capabilities could write root's sysctls; this uid cannot (and
        # writing the current value back would change nothing if it could)
        probe = box.exec("cat /proc/sys/vm/overcommit_ratio > /proc/sys/vm/overcommit_ratio")
        assert probe.exit_code != 0 and "denied" in probe.output, probe.output
        assert box.exec("ls /sys | wc -l").output == "0\n"  # no sysfs at all
        assert os.stat(box.info()["workspace"]).st_uid == uid
    finally:
        box.close()


def test_apptainer_cgroup_holds_memory_pids_and_cpus(sif_image, sandbox_root):
    from sandboxes.runtimes.singularity import SingularityConfig, use_cgroups

    if not use_cgroups(SingularityConfig()):
        pytest.skip("apptainer's cgroup limits are used only where the host is root")
    spec = SandboxSpec(limits=Limits(memory_mb=96, pids=48, cpus=0.5, nofile=300, disk_mb=20))
    box = open_box(sif_image, sandbox_root, spec)
    try:
        hog = box.exec("python3 -c \"b = bytearray(300 << 20); print('allocated')\"", timeout=60)
        assert "allocated" not in hog.output.splitlines() and hog.exit_code == 137, hog
        forks = box.exec("python3 -c \"import os, time\nn = 0\ntry:\n    while n < 200:\n"
                         "        if os.fork() == 0:\n            time.sleep(60); os._exit(0)\n"
                         "        n += 1\nexcept OSError as exc:\n    print('stopped', n, exc.errno)\"",
                         timeout=60)
        assert forks.output.startswith("stopped") and int(forks.output.split()[1]) < 48, forks
        assert box.exec("ulimit -n").output == "300\n"
        # disk_mb: the workspace's own filesystem where the host makes one, else RLIMIT_FSIZE
        big = box.exec("head -c 30000000 /dev/zero > ~/big; echo $?; wc -c < ~/big", timeout=60)
        status, size = big.output.split()[-2:]
        assert status != "0" and int(size) <= 20 * 1024 * 1024, big
        cpu = _cgroup_dir(box.info()["init_pid"], "cpu")
        if cpu and (cpu / "cpu.cfs_quota_us").exists():
            quota, period = (int((cpu / f"cpu.cfs_{n}_us").read_text()) for n in ("quota", "period"))
            assert quota / period == 0.5
        assert box.exec("echo alive").output == "alive\n"  # the shell outlived its hog
    finally:
        box.close()


def test_close_leaves_nothing(sif_image, sandbox_root):
    from sandboxes.runtimes.procs import descendant_pids, wait_dead

    box = open_box(sif_image, sandbox_root)
    box.exec("(setsid sleep 300 &); sleep 301 & (trap '' TERM; sleep 302) &")
    info = box.info()
    pids = [info["pid"], info["init_pid"], *descendant_pids(info["pid"])]
    assert len(pids) >= 6
    cgroup = _cgroup_dir(info["init_pid"], "pids")
    box.close()
    assert wait_dead(pids, timeout=5), [p for p in pids if os.path.exists(f"/proc/{p}")]
    assert not os.path.exists(info["workspace"])
    if info["uid"]:
        left = _uid_processes(info["uid"])
        assert not left, [_stat(pid) for pid in left]
    if cgroup and cgroup.name == str(info["init_pid"]):  # apptainer's own, per container
        deadline = time.monotonic() + 5
        while cgroup.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not cgroup.exists()


def test_request_env_reaches_only_the_shell_inside(sif_image, sandbox_root):
    secret = "s3cret-" + hashlib.sha1(os.urandom(8)).hexdigest()
    box = open_box(sif_image, sandbox_root, SandboxSpec(env={"API_KEY": secret}))
    try:
        assert box.exec('echo "$API_KEY"').output == f"{secret}\n"
        inside = box.exec("env").output
        assert "PRORL_" not in inside and "PAGER=cat" in inside  # nothing of the host's own
        info = box.info()
        for pid in [info["pid"], info["init_pid"], info["shell_pid"]]:
            for part in ("cmdline", "environ"):
                assert secret.encode() not in Path(f"/proc/{pid}/{part}").read_bytes(), (pid, part)
    finally:
        box.close()


def test_a_killed_host_takes_its_containers_along(start_host, sif_image, sandbox_root):
    from sandboxes.runtimes.procs import alive

    host = start_host(runtimes="singularity", runtime_config={"singularity": {"root": str(sandbox_root)}},
                      env={"PRORL_APPTAINER_BIN": os.environ["PRORL_APPTAINER_BIN"],
                           "PRORL_SANDBOX_IMAGE_DIRS": str(IMAGES)})
    sandbox = create(host, "doomed-job", spec={"runtime": "singularity", "image": sif_image})
    assert sandbox.exec("(setsid sleep 300 &); echo started").output == "started\n"
    info = sandbox.info()
    init_pid = info["init_pid"]
    assert alive(init_pid)
    host.proc.kill()
    host.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while alive(init_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(init_pid)
    if info.get("uid"):
        left = _uid_processes(info["uid"])
        assert not left, [_stat(pid) for pid in left]



# -- docker:// through apptainer pull ------------------------------------------------------------
def test_docker_image_from_the_local_registry_is_pulled_once_and_typed_when_missing(
        apptainer_bin, registry, python_image, sandbox_root, tmp_path):
    """tests/registry.py's image (Python and pytest, pushed with skopeo) as a SIF: pulled over
    plain HTTP (the test operator lists the registry as insecure), then from the cache."""
    from prorl_celery.errors import ImageNotFound
    from sandboxes.runtimes.singularity import SingularitySandbox

    config = {"root": str(sandbox_root), "cache_dir": str(tmp_path / "sif-cache")}
    spec = SandboxSpec(image=python_image)
    fetched = []
    for attempt in range(2):
        box = SingularitySandbox(spec, f"pull-{attempt}", config)
        try:
            out = box.exec("python3 -m pytest --version")
            assert out.exit_code == 0 and out.output.startswith("pytest "), out
            assert box.info()["image"].startswith(str(tmp_path / "sif-cache"))
        finally:
            box.close()
        fetched.append(registry.blob_fetches("prorl/python"))
    assert fetched[0] > 0 and fetched[1] == fetched[0]  # the second sandbox pulled nothing
    with pytest.raises(ImageNotFound):
        SingularitySandbox(spec.model_copy(update={"image": registry.ref("prorl/python", "nope")}),
                           "pull-missing", config)
    assert os.listdir(sandbox_root) == []


# -- a SWE fixture through the whole service, in the SIF ---------------------------------------
ORACLE = ["--policy", "oracle:prorl_celery.fakes.oracle:reply", "--latency-model", "none"]


@pytest.fixture(scope="module")
def sif_service(apptainer_bin, sif_image, tmp_path_factory):
    """A stack of its own (own Redis) whose sandbox host serves singularity, with the SIFs'
    directory registered as an image directory."""
    from prorl_celery.ops.launcher import Stack, StackOptions
    from tests.conftest import TEST_ENV

    env = {**TEST_ENV, "PRORL_APPTAINER_BIN": apptainer_bin, "PRORL_SANDBOX_IMAGE_DIRS": str(IMAGES)}
    options = StackOptions(state_dir=tmp_path_factory.mktemp("sif-stack"), persist=False, env=env,
                           concurrency={"init": 2, "run": 2, "eval": 2, "maint": 1})
    with Stack(options) as stack:
        yield stack


def use_llm(stack, name: str, args: list[str]) -> None:
    """Make the fake LLM server with ``args`` (an oracle policy) the stack's only backend."""
    import requests

    requests.post(f"{stack.api_url}/clear_llm_server", timeout=10)
    url = stack.start_fake_llm(name=name, extra_args=args)
    resp = requests.post(f"{stack.api_url}/llm_servers", json={"address": url, "protocol": "chat"},
                         timeout=10)
    assert resp.status_code == 201, resp.text


def test_swe_fixture_resolves_in_a_sif_through_the_service(sif_service, sif_image, tmp_path):
    from prorl_celery.fakes import swe
    from tests.conftest import submit, wait

    use_llm(sif_service, "fake-oracle", ORACLE)
    instance = swe.build("calkit", tmp_path / "repos")
    instance["sandbox"] = {"runtime": "singularity", "image": sif_image}
    view = wait(sif_service.api_url, submit(sif_service.api_url, instance), timeout=300)
    assert view["status"] == "completed", view["result"]
    result = view["result"]
    assert result["sandbox"]["runtime"] == "singularity", result["sandbox"]
    assert result["resolved"] is True and result["reward"] == 1.0, result["eval"]
    assert result["eval"]["FAIL_TO_PASS"] == {t: "PASSED" for t in instance["FAIL_TO_PASS"]}
    assert result["eval"]["PASS_TO_PASS"] == {t: "PASSED" for t in instance["PASS_TO_PASS"]}
    assert "calkit/years.py" in result["git_patch"]


# -- a real SWE-bench row, in a SIF of the environment its recipe builds ------------------------
# the row with parametrized ids holding spaces and a test log of ~70,000 characters
REAL_ROW = os.environ.get("PRORL_APPTAINER_SWEBENCH_ROW", "pytest-dev__pytest-11143")


def _listed(row: dict, field: str) -> list[str]:
    import json

    value = row[field]
    return json.loads(value) if isinstance(value, str) else list(value)


@pytest.fixture(scope="module")
def real_row(apptainer_bin, tmp_path_factory):
    """The row at its base_commit (tests/real/swebench_data.py), its environment built by
    sandboxes/runtimes/env/build.py (or found in its cache) and made a SIF here."""
    real = pytest.importorskip("tests.real.test_swebench", reason="no real SWE-bench rows here")
    from sandboxes.runtimes.env.build import EnvBuildFailed, ensure_env

    rows = real.swebench_data.rows()
    row_id = REAL_ROW
    if row_id not in rows:
        pytest.skip(f"no SWE-bench row {row_id!r} in tests/fixtures/swebench")
    row = rows[row_id]
    repo = real.swebench_data.materialize(row, tmp_path_factory.mktemp("swebench") / row_id)
    try:
        env = ensure_env(real.recipe_of(row_id, repo))
    except EnvBuildFailed as exc:
        pytest.skip(f"the environment of {row_id} does not build here: {str(exc)[-600:]}")
    IMAGES.mkdir(parents=True, exist_ok=True)
    sif = IMAGES / f"{Path(env).name}.sif"
    if not sif.exists():
        build_sif(apptainer_bin, Path(env), sif)
    instance = {**row, "data_source": "swebench", "repo_source": str(repo),
                "sandbox": {"runtime": "singularity", "image": str(sif)}}
    return instance, real.ORACLE


def test_real_swebench_row_resolves_in_a_sif_of_its_environment(sif_service, real_row):
    from tests.conftest import submit, wait

    instance, oracle = real_row
    use_llm(sif_service, "swebench-oracle", oracle)
    view = wait(sif_service.api_url, submit(sif_service.api_url, instance), timeout=600)
    assert view["status"] == "completed", view["result"]
    result = view["result"]
    assert result["sandbox"]["runtime"] == "singularity", result["sandbox"]
    grades = result["eval"]
    not_passed = {t: v for field in ("FAIL_TO_PASS", "PASS_TO_PASS")
                  for t, v in grades.get(field, {}).items() if v != "PASSED"}
    assert result["resolved"] is True and result["reward"] == 1.0, (
        not_passed, {k: v for k, v in grades.items() if k not in ("FAIL_TO_PASS", "PASS_TO_PASS")})
    assert grades["FAIL_TO_PASS"] == {t: "PASSED" for t in _listed(instance, "FAIL_TO_PASS")}
    assert grades["PASS_TO_PASS"] == {t: "PASSED" for t in _listed(instance, "PASS_TO_PASS")}
