"""The singularity runtime without Apptainer: its command lines (pure functions), the limits it
leaves to the shell, the image cache and the CLI helper's time limit (on real processes). The
runtime itself runs on a real Apptainer in tests/sandboxes/test_apptainer.py (-m apptainer)."""
from __future__ import annotations

import os
import time

import pytest

from prorl_celery.errors import SandboxError
from sandboxes.runtimes import singularity as sif
from sandboxes.runtimes.images import sif as sif_images
from sandboxes.base import Limits, SandboxSpec
from sandboxes.runtimes.procs import wait_dead
from sandboxes.runtimes.singularity import SingularityConfig



def test_exec_argv_contains_the_container_and_names_nothing_of_the_request():
    argv = sif.exec_argv("/opt/apptainer", SingularityConfig(cgroups=False), image="/img/a.sif",
                         workspace_dir="/scratch/ws1", workdir="/workspace/repo",
                         limits=Limits(), uid=None)
    assert argv == ["/opt/apptainer", "--quiet", "exec", "--containall", "--no-privs", "--no-home",
                    "--net", "--network", "none", "--hostname", "sandbox",
                    "--no-mount", "sys,bind-paths,cwd", "--bind", "/scratch/ws1:/workspace",
                    "--pwd", "/workspace/repo", "/img/a.sif", "bash", "--noprofile", "--norc"]


def test_exec_argv_as_root_its_uid_and_cgroup_limits():
    config = SingularityConfig(cgroups=True, writable_tmpfs=True, extra_options=["--nv"],
                               mount="/testbed", shell=["bash"])
    argv = sif.exec_argv("apptainer", config, image="i.sif", workspace_dir="/w", workdir="/testbed",
                         limits=Limits(memory_mb=512, cpus=1.5, pids=64), uid=1000007)
    assert argv[argv.index("--security") + 1] == "uid:1000007,gid:1000007"
    assert "--writable-tmpfs" in argv and argv[-3:] == ["--nv", "i.sif", "bash"]
    assert sif.limit_options(Limits(memory_mb=512, cpus=1.5, pids=64), True) == [
        "--memory", "512M", "--memory-swap", "512M", "--cpus", "1.5", "--pids-limit", "64"]
    assert all(flag in argv for flag in ("--memory", "--cpus", "--pids-limit"))
    assert sif.limit_options(Limits(memory_mb=512, cpus=None, pids=None), False) == []


def test_the_shell_keeps_what_no_cgroup_or_filesystem_holds():
    limits = Limits(memory_mb=512, pids=64, disk_mb=100, nofile=99)
    held = sif.shell_rlimits(limits, cgroups=True, own_uid=True, quota=True)
    assert (held.memory_mb, held.nproc, held.fsize_mb, held.nofile) == (None, None, None, 99)
    bare = sif.shell_rlimits(limits, cgroups=False, own_uid=True, quota=False)
    assert (bare.memory_mb, bare.nproc, bare.fsize_mb) == (512, 64, 100)  # RLIMIT_AS, NPROC, FSIZE
    shared_uid = sif.shell_rlimits(limits, cgroups=False, own_uid=False, quota=False)
    assert shared_uid.nproc is None  # the host's own uid: a per-uid count would be everyone's


def test_environment_inside_is_bwraps_defaults_then_the_request():
    env = sif.inner_env(SingularityConfig(), SandboxSpec(env={"PAGER": "less", "A": "1 2"}))
    assert env["HOME"] == "/workspace" and env["TMPDIR"] == "/tmp" and env["GIT_PAGER"] == "cat"
    assert env["PAGER"] == "less" and env["A"] == "1 2"
    assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def test_instance_names_left_by_older_runtimes_are_recognised():
    assert sif.parse_instance_name("prorl.job.7-a_b.1700000000123.abc123") == ("job.7-a_b", 1700000000.123)
    for foreign in ("myjob", "prorl.x", "other.job.1.ab", "prorl.job.notatime.ab"):
        assert sif.parse_instance_name(foreign) is None


def test_images_are_pulled_once_into_the_cache(tmp_path):
    ref = "docker://ubuntu:22.04"
    cached = sif_images.cached_image_path(str(tmp_path), ref)
    assert cached == sif_images.cached_image_path(str(tmp_path), ref) != sif_images.cached_image_path(str(tmp_path), "docker://x")
    with open(cached, "wb") as fh:
        fh.write(b"SIF")
    assert sif_images.pull_image("/nonexistent/apptainer", ref, str(tmp_path), timeout=5) == cached


def test_a_failed_pull_is_an_error_and_leaves_no_image(tmp_path):
    with pytest.raises(SandboxError, match="could not pull image 'docker://nope:1'"):
        sif_images.pull_image("/bin/false", "docker://nope:1", str(tmp_path), timeout=5)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_a_cli_call_over_its_time_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "child.pid"
    started = time.monotonic()
    with pytest.raises(SandboxError, match="took over"):
        sif_images.run_cli(["sh", "-c", f"sleep 30 & echo $! > {marker}; wait"], timeout=0.5)
    assert time.monotonic() - started < 3
    assert wait_dead([int(marker.read_text())], timeout=2)


def test_a_configured_binary_that_is_missing_is_no_binary():
    assert sif.binary("/nonexistent/apptainer") is None
    assert sif.binary("/bin/true") == "/bin/true"


def test_without_a_binary_it_is_unavailable_and_says_how_to_get_one(sandbox_root):
    if sif.binary() is not None:  # asked now: an -m apptainer run in this session installs one
        pytest.skip("an apptainer binary is here")
    assert not sif.SingularitySandbox.available()
    assert sif.list_instances() == []
    from sandboxes.registry import available_runtimes

    assert "singularity" not in available_runtimes()
    with pytest.raises(SandboxError, match="install-apptainer.sh"):
        sif.SingularitySandbox(SandboxSpec(image="/x.sif"), "j", {"root": str(sandbox_root)})
    assert os.listdir(sandbox_root) == []  # its workspace went with it


def test_a_network_sandbox_is_refused(sandbox_root):
    with pytest.raises(SandboxError, match="no isolated network"):
        sif.SingularitySandbox(SandboxSpec(image="/x.sif", network=True), "j",
                               {"root": str(sandbox_root), "binary": "/bin/true"})
    assert os.listdir(sandbox_root) == []
