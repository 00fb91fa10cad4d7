"""The singularity runtime's command lines and spython's traps, checked without a binary: the
argv is built by pure functions, and real spython is run where it fails on its own (no binary,
a bad URI). The runtime's contract test (test_contract.py) needs a real apptainer."""
from __future__ import annotations

import shutil

import pytest

from prorl_celery.errors import SandboxError
from sandboxes import singularity as sif
from sandboxes.base import SandboxSpec
from sandboxes.singularity import SingularityConfig

no_binary = pytest.mark.skipif(shutil.which("singularity") is not None,
                               reason="spython would really start an instance here")


def test_instance_names_carry_job_id_and_start_time():
    name = sif.instance_name("job.7-a_b", 1700000000.123, "abc123")
    assert name == "prorl.job.7-a_b.1700000000123.abc123"
    assert sif.parse_instance_name(name) == ("job.7-a_b", 1700000000.123)
    assert sif.parse_instance_name(sif.instance_name("we/ird id", 5.0, "ff")) == ("we_ird_id", 5.0)
    for foreign in ("myjob", "prorl.x", "other.job.1.ab", "prorl.job.notatime.ab"):
        assert sif.parse_instance_name(foreign) is None


def test_start_options():
    config = SingularityConfig()
    assert sif.start_options(config, SandboxSpec(), "/scratch/ws1") == [
        "--writable-tmpfs", "--contain", "--no-home", "--cleanenv",
        "--net", "--network", "none", "--bind", "/scratch/ws1:/workspace"]
    config = SingularityConfig(fakeroot=True, extra_options=["--nv"], mount="/testbed")
    assert sif.start_options(config, SandboxSpec(network=True), "/w") == [
        "--writable-tmpfs", "--contain", "--no-home", "--cleanenv", "--fakeroot",
        "--bind", "/w:/testbed", "--nv"]


@no_binary
def test_spython_builds_exactly_our_start_command_and_its_failure_is_an_error():
    options = sif.start_options(SingularityConfig(), SandboxSpec(), "/w")
    instance = sif.new_instance("/images/ubuntu.sif", "prorl.j1.1000.aa")
    with pytest.raises(SandboxError):  # no binary: spython's Popen fails, we raise
        sif.start_instance(instance, options, timeout=30)
    assert instance.cmd == sif.start_argv("/images/ubuntu.sif", "prorl.j1.1000.aa", options)
    assert instance.cmd == ["singularity", "--quiet", "instance", "start", "--writable-tmpfs",
                            "--contain", "--no-home", "--cleanenv", "--net", "--network", "none",
                            "--bind", "/w:/workspace", "/images/ubuntu.sif", "prorl.j1.1000.aa"]


def test_shell_attaches_to_the_instance_with_a_clean_environment():
    argv = sif.shell_argv("/usr/bin/apptainer", "prorl.j.1.ab", {"B": "2 3", "A": "1"},
                          "/workspace/repo", ["bash", "--noprofile", "--norc"])
    assert argv == ["/usr/bin/apptainer", "exec", "--cleanenv", "--env", "A=1", "--env", "B=2 3",
                    "--pwd", "/workspace/repo", "instance://prorl.j.1.ab",
                    "bash", "--noprofile", "--norc"]


def test_sys_exit_inside_spython_becomes_a_sandbox_error():
    # spython's pull calls sys.exit for a URI scheme it does not know; a worker must not exit
    with pytest.raises(SandboxError, match="spython gave up"):
        sif.spython_call(sif.client().pull, "ftp://example.org/image")


def test_images_are_pulled_once_into_the_cache(tmp_path):
    ref = "docker://ubuntu:22.04"
    cached = sif.cached_image_path(str(tmp_path), ref)
    assert cached == sif.cached_image_path(str(tmp_path), ref) != sif.cached_image_path(str(tmp_path), "docker://x")
    with open(cached, "wb") as fh:
        fh.write(b"SIF")
    assert sif.pull_image(ref, str(tmp_path), timeout=5) == cached  # no pull: it is there


@no_binary
def test_without_a_binary_it_is_unavailable_and_lists_nothing():
    assert not sif.SingularitySandbox.available()
    assert sif.list_instances() == []
    from sandboxes.registry import available_runtimes

    assert "singularity" not in available_runtimes()
