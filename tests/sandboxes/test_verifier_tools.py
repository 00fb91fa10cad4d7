"""The verifier toolkit (sandboxes/runtimes/images/verifier_tools.py): its curl and wget answer
uv's installer URLs with the toolkit's installer and hand everything else to the real program;
the installer puts uv where uv's own would; the toolkit is built once. Most tests run the real
scripts on a toolkit laid out around stub uv binaries (no network); the ``harbor`` ones download
uv from PyPI and grade a Harbor cookbook test.sh in a real bwrap sandbox."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import pytest

from prorl_celery.errors import EnvBuildFailed, UnsafeDirectory
from sandboxes.runtimes.images import verifier_tools as vt

OURS = vt.UV_VERSION
INSTALLER_URLS = {
    "https://astral.sh/uv/install.sh": "latest",
    "https://astral.sh/uv/0.9.7/install.sh": "0.9.7",
    "http://astral.sh/uv/0.4.6/install.sh": "0.4.6",
    "astral.sh/uv/install.sh": "latest",
    "https://github.com/astral-sh/uv/releases/download/0.9.7/uv-installer.sh": "0.9.7",
    "https://github.com/astral-sh/uv/releases/latest/download/uv-installer.sh": "latest",
    "https://releases.astral.sh/github/uv/releases/download/0.8.4/uv-installer.sh": "0.8.4",
}
OTHER_URLS = [
    "https://astral.sh/uv/0.9.7/install.sh.evil.com/x",
    "https://astral.sh.evil.com/uv/install.sh",
    "https://evil.com/astral.sh/uv/install.sh",
    "https://astral.sh/uv/install.sh?x=1",
    "https://astral.sh/uv/install.sh#x",
    "https://astral.sh/uv/0.9.7/../install.sh",
    "https://astral.sh/uv/0.9.7/x/install.sh",
    "https://astral.sh/uv/latest;rm -rf ~/install.sh",
    "https://astral.sh/uv//install.sh",
    "https://astral.sh/uv/install.ps1",
    "https://user@astral.sh/uv/install.sh",
    "ftp://astral.sh/uv/install.sh",
    "https://github.com/astral-sh/uv/releases/download/0.9.7/uv-x86_64-unknown-linux-gnu.tar.gz",
    "https://github.com/evil/uv/releases/download/0.9.7/uv-installer.sh",
    "https://pypi.org/simple/uv/",
]


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def toolkit(tmp_path_factory) -> Path:
    """A toolkit laid out by :func:`assemble` around stub uv binaries."""
    work = tmp_path_factory.mktemp("toolkit")
    uv = _script(work / "uv", f"#!/bin/sh\necho 'uv {OURS} (stub)'\n")
    uvx = _script(work / "uvx", f"#!/bin/sh\necho 'uvx {OURS} (stub)'\n")
    return vt.assemble(work / "tools", uv, uvx)


@pytest.fixture
def real(tmp_path) -> Path:
    """A directory of stand-in curl and wget that record how they were called and exit 7."""
    bin_dir = tmp_path / "real-bin"
    bin_dir.mkdir()
    for name in ("curl", "wget"):
        _script(bin_dir / name, '#!/bin/sh\nprintf "%s\\n" "$0" "$@" > "$RECORD"\nexit 7\n')
    return bin_dir


def run(tool: Path, args: list[str], cwd: Path, path: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool), *args], cwd=cwd, capture_output=True, text=True, timeout=30,
                          env={"PATH": path, "HOME": str(cwd), "RECORD": str(cwd / "record"), **env})


def served(text: str, asked: str) -> bool:
    return text.startswith("#!/bin/sh\n") and f"PRORL_ASKED_UV='{asked}'" in text \
        and "installs the uv and uvx this toolkit ships" in text


# -- which requests the wrappers answer --------------------------------------------------------
@pytest.mark.parametrize("url", INSTALLER_URLS)
@pytest.mark.parametrize("argv", [["curl", "-LsSf"], ["curl", "--proto", "=https", "--tlsv1.2", "-fsSL"],
                                  ["wget", "-qO-"], ["wget", "-q", "-O", "-"]])
def test_installer_urls_are_answered_by_the_toolkit(toolkit, real, tmp_path, url, argv):
    done = run(toolkit / "bin" / argv[0], [*argv[1:], url], tmp_path, f"{toolkit}/bin:{real}:/usr/bin:/bin")
    assert done.returncode == 0, done.stderr
    assert served(done.stdout, INSTALLER_URLS[url])
    assert f"PRORL_TOOLS='{toolkit}'" in done.stdout
    assert not (tmp_path / "record").exists()  # the real program was never asked


@pytest.mark.parametrize("url", OTHER_URLS)
@pytest.mark.parametrize("name", ["curl", "wget"])
def test_every_other_request_goes_to_the_real_program_unchanged(toolkit, real, tmp_path, url, name):
    args = ["-sS", "-H", "Accept: */*", url] if name == "curl" else ["-q", url]
    done = run(toolkit / "bin" / name, args, tmp_path, f"{toolkit}/bin:{real}:/usr/bin:/bin")
    assert done.returncode == 7  # the real one's status
    assert (tmp_path / "record").read_text().splitlines() == [str(real / name), *args]


def test_the_real_program_is_the_next_one_on_path_after_ours(toolkit, real, tmp_path):
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    _script(earlier / "curl", "#!/bin/sh\nexit 9\n")
    path = f"{earlier}:{toolkit}/bin:{real}:/usr/bin"
    assert run(toolkit / "bin" / "curl", ["https://example.org/"], tmp_path, path).returncode == 7
    # called by a path not on PATH: the first curl on PATH
    assert run(toolkit / "bin" / "curl", ["https://example.org/"], tmp_path, f"{earlier}:/usr/bin").returncode == 9


def test_without_a_real_program_it_fails_as_a_missing_command(toolkit, tmp_path):
    only_cat = tmp_path / "only-cat"  # an image without curl and wget
    only_cat.mkdir()
    (only_cat / "cat").symlink_to("/bin/cat")
    path = f"{toolkit}/bin:{only_cat}"
    for name, flags in (("curl", ["-fsSL"]), ("wget", ["-qO-"])):
        done = run(toolkit / "bin" / name, ["https://example.org/"], tmp_path, path)
        assert done.returncode == 127
        assert f"{name}: command not found" in done.stderr
        done = run(toolkit / "bin" / name, [*flags, "https://astral.sh/uv/install.sh"], tmp_path, path)
        assert done.returncode == 0 and served(done.stdout, "latest")  # the installer still is


@pytest.mark.parametrize("argv, written", [
    (["curl", "-LsSf", "-o", "out/i.sh"], "out/i.sh"),
    (["curl", "-sSLo", "out/i.sh"], "out/i.sh"),
    (["curl", "-sSLoout/i.sh"], "out/i.sh"),
    (["curl", "--output", "out/i.sh", "-L"], "out/i.sh"),
    (["curl", "-LO"], "install.sh"),
    (["curl", "--output-dir", "out", "--remote-name"], "out/install.sh"),
    (["wget", "-q"], "install.sh"),
    (["wget", "-nv", "-O", "out/i.sh"], "out/i.sh"),
    (["wget", "-qOout/i.sh"], "out/i.sh"),
    (["wget", "--output-document=out/i.sh"], "out/i.sh"),
    (["wget", "-P", "out"], "out/install.sh"),
])
def test_output_files(toolkit, real, tmp_path, argv, written):
    (tmp_path / "out").mkdir()
    done = run(toolkit / "bin" / argv[0], [*argv[1:], "https://astral.sh/uv/0.9.7/install.sh"], tmp_path,
               f"{toolkit}/bin:{real}:/usr/bin:/bin")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert served((tmp_path / written).read_text(), "0.9.7")


def test_values_of_other_options_are_not_output_names(toolkit, real, tmp_path):
    done = run(toolkit / "bin" / "curl", ["-XGET", "-AMozilla/5.0", "-H", "-o", "-o-",
                                          "https://astral.sh/uv/install.sh"], tmp_path,
               f"{toolkit}/bin:{real}:/usr/bin:/bin")
    assert done.returncode == 0 and served(done.stdout, "latest")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real-bin"]  # no file written


# -- the installer -----------------------------------------------------------------------------
def install(toolkit: Path, home: Path, url: str = "https://astral.sh/uv/0.9.7/install.sh",
            sh_args: str = "", **env) -> subprocess.CompletedProcess:
    command = f"curl -LsSf {shlex.quote(url)} | sh -s -- {sh_args}; echo \"rc=$?\" >&2"
    return subprocess.run(["bash", "-c", command], cwd=home, capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{toolkit}/bin:/usr/bin:/bin", "HOME": str(home), **env})


def sourced_uv(home: Path, env_file: str) -> str:
    done = subprocess.run(["bash", "-c", f"source {env_file} && command -v uv && uv --version"], cwd=home,
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(home)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_installer_installs_ours_where_uvs_would_and_says_so(toolkit, tmp_path):
    done = install(toolkit, tmp_path)
    assert "rc=0" in done.stderr
    assert "asked for uv 0.9.7" in done.stderr and f"installs uv {OURS}" in done.stderr
    assert f"installing uv {OURS}" in done.stdout and "source $HOME/.local/bin/env" in done.stdout
    bin_dir = tmp_path / ".local" / "bin"
    assert (bin_dir / "uv").read_bytes() == (toolkit / "bin" / "uv").read_bytes()
    assert os.access(bin_dir / "uvx", os.X_OK)
    assert sourced_uv(tmp_path, "$HOME/.local/bin/env") == f"{bin_dir}/uv\nuv {OURS} (stub)\n"
    assert '. "$HOME/.local/bin/env"' in (tmp_path / ".profile").read_text()
    assert 'source "$HOME/.local/bin/env.fish"' in (tmp_path / ".config/fish/conf.d/uv.env.fish").read_text()
    assert '"$HOME/.local/bin"' in (bin_dir / "env.fish").read_text()
    again = install(toolkit, tmp_path, "https://astral.sh/uv/install.sh")  # idempotent; latest: no note
    assert "rc=0" in again.stderr and "asked for" not in again.stderr
    assert (tmp_path / ".profile").read_text().count(".local/bin/env") == 1


def test_the_installer_honours_uvs_variables(toolkit, tmp_path):
    custom = tmp_path / "custom bin"
    done = install(toolkit, tmp_path, f"https://astral.sh/uv/{OURS}/install.sh", UV_INSTALL_DIR=str(custom))
    assert "rc=0" in done.stderr and "asked for" not in done.stderr
    assert sourced_uv(tmp_path, shlex.quote(f"{custom}/env")).startswith(f"{custom}/uv\n")
    assert '"$HOME/custom bin"' in (custom / "env").read_text()  # late-bound beneath HOME

    home, xdg = tmp_path / "h1", tmp_path / "xdg"
    home.mkdir()
    assert "rc=0" in install(toolkit, home, XDG_BIN_HOME=str(xdg)).stderr
    assert (xdg / "uv").is_file() and (xdg / "env").is_file()

    home = tmp_path / "h2"
    home.mkdir()
    done = install(toolkit, home, UV_NO_MODIFY_PATH="1")
    assert "rc=0" in done.stderr and (home / ".local/bin/env").is_file()  # still sourceable
    assert not (home / ".profile").exists() and not (home / ".config").exists()

    home = tmp_path / "h3"
    home.mkdir()
    done = install(toolkit, home, UV_UNMANAGED_INSTALL=str(home / "unmanaged"))
    assert (home / "unmanaged" / "uv").is_file() and not (home / ".profile").exists()

    home = tmp_path / "h4"
    home.mkdir()
    (home / ".bashrc").write_text("# mine\n")
    done = install(toolkit, home, sh_args="-q")
    assert done.stdout == "" and "rc=0" in done.stderr
    assert '. "$HOME/.local/bin/env"' in (home / ".bashrc").read_text()
    assert "unknown option --bogus" in install(toolkit, home, sh_args="--bogus").stderr


# -- building ------------------------------------------------------------------------------------
def fake_wheel(directory: Path) -> Path:
    wheel = directory / f"uv-{OURS}-py3-none-musllinux_1_1_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in ("uv", "uvx"):
            archive.writestr(f"uv-{OURS}.data/scripts/{name}", f"#!/bin/sh\necho '{name} {OURS} (stub)'\n")
    return wheel


def test_built_once_for_concurrent_callers_and_checked_when_found(monkeypatch, sandbox_root):
    downloads = []

    def download(scratch: Path) -> Path:
        downloads.append(scratch)
        time.sleep(0.3)  # long enough for the other caller to wait on the lock
        return fake_wheel(scratch)

    monkeypatch.setattr(vt, "_download", download)
    root = sandbox_root / "tools"
    results: list = []

    def ensure() -> None:
        try:
            results.append(vt.ensure_tools(root))
        except Exception as exc:  # noqa: BLE001 - asserted below
            results.append(exc)

    threads = [threading.Thread(target=ensure) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(downloads) == 1 and len(set(results)) == 1, results
    tools = results[0]
    assert tools.parent == root and tools.name.startswith(f"uv-{OURS}-b{vt.BUILDER}-")
    ca = vt.trust_store()
    assert (tools / vt.CA_BUNDLE).read_bytes() == ca.read_bytes() if ca else not (tools / vt.CA_BUNDLE).exists()
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == [tools.name]
    assert (tools.stat().st_mode & 0o777, (tools / "bin" / "uv").stat().st_mode & 0o777) == (0o755, 0o755)
    assert (tools / "share" / "uv-installer.sh").stat().st_mode & 0o777 == 0o644
    assert f"ours='{OURS}'" in (tools / "share" / "uv-installer.sh").read_text()
    assert subprocess.run([tools / "bin" / "uv"], capture_output=True, text=True).stdout == f"uv {OURS} (stub)\n"
    assert vt.ensure_tools(root) == tools and len(downloads) == 1
    (tools / "bin").chmod(0o775)  # someone else could have changed it: not used
    with pytest.raises(UnsafeDirectory):
        vt.ensure_tools(root)


def test_a_toolkit_sandbox_uids_cannot_reach_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only a root host runs sandboxes as other uids")
    with pytest.raises(EnvBuildFailed, match="sandbox uids cannot enter"):
        vt.ensure_tools(tmp_path / "root")  # pytest's tmp_path is 0700


def test_a_failed_build_leaves_nothing(monkeypatch, sandbox_root):
    def broken(scratch: Path) -> Path:
        raise EnvBuildFailed("pip could not download uv")

    monkeypatch.setattr(vt, "_download", broken)
    with pytest.raises(EnvBuildFailed, match="could not download"):
        vt.ensure_tools(sandbox_root / "tools")
    assert [p.name for p in (sandbox_root / "tools").iterdir() if not p.name.endswith(".lock")] == []


def test_sandbox_settings(toolkit, tmp_path):
    assert vt.sandbox_binds(Path("/var/cache/x/uv-1")) == {"/var/cache/x/uv-1": "/opt/prorl-tools"}
    assert vt.sandbox_path("/usr/bin:/bin") == "/opt/prorl-tools/bin:/usr/bin:/bin"
    assert vt.sandbox_env(toolkit, "/bin") == {"PATH": "/opt/prorl-tools/bin:/bin"}  # no trust store in it
    with_ca = vt.assemble(tmp_path / "tools", toolkit / "bin" / "uv", toolkit / "bin" / "uvx", ca=b"PEM")
    env = vt.sandbox_env(with_ca, "/bin")
    assert env.pop("PATH") == "/opt/prorl-tools/bin:/bin"
    assert env == dict.fromkeys(vt.CA_VARIABLES, "/opt/prorl-tools/share/ca-certificates.crt")
    from sandboxes.base import SandboxSpec

    SandboxSpec(env=env)  # a sandbox may be given them


# -- for real: PyPI's uv, a cookbook test.sh, a bwrap sandbox ---------------------------------------
# harbor-cookbook's tests/test.sh, line for line; only /tests and /logs are moved under the
# workspace (this sandbox's root is the host's, read-only)
COOKBOOK_TEST_SH = """#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh
source $HOME/.local/bin/env
uvx --with pytest==8.4.1 --with pytest-json-ctrf==0.3.5 pytest --ctrf /workspace/logs/verifier/ctrf.json /workspace/tests/test_state.py -rA
if [ $? -eq 0 ]; then echo 1 > /workspace/logs/verifier/reward.txt; else echo 0 > /workspace/logs/verifier/reward.txt; fi
"""
PASSING = "def test_state():\n    assert sum([1, 2]) == 3\n"
FAILING = "def test_state():\n    assert sum([1, 2]) == 4\n"


@pytest.fixture(scope="module")
def real_toolkit() -> Path:
    """The toolkit built from PyPI's uv wheel, under a directory sandbox uids can enter."""
    root = Path(tempfile.mkdtemp(prefix="prorl-test-verifier-tools-"))
    root.chmod(0o711)
    yield vt.ensure_tools(root / "tools")
    subprocess.run(["rm", "-rf", str(root)], check=False)


def grade(box, test_file: str) -> tuple[str, float, str]:
    """(reward.txt, seconds, output) of the cookbook script on ``test_file``."""
    # the two test files have one size: within one second, the first one's cached bytecode would be
    # taken for the second (pytest's rewrite cache keys on mtime and size), as in a fresh verifier never
    box.exec("rm -rf /workspace/logs /workspace/tests/__pycache__ && mkdir -p /workspace/tests /workspace/logs/verifier")
    box.write_file("/workspace/tests/test.sh", COOKBOOK_TEST_SH.encode())
    box.write_file("/workspace/tests/test_state.py", test_file.encode())
    started = time.monotonic()
    done = box.exec("bash /workspace/tests/test.sh", timeout=600)
    seconds = time.monotonic() - started
    assert done.exit_code == 0, done.output
    return box.read_file("/workspace/logs/verifier/reward.txt").decode().strip(), seconds, done.output


@pytest.mark.harbor
def test_a_cookbook_test_sh_grades_offline_but_for_pypi(real_toolkit, sandbox_root):
    from sandboxes.base import SandboxSpec
    from sandboxes.runtimes.bwrap import HOST_PATHS, SANDBOX_PATH, BwrapSandbox, bwrap_works

    if not bwrap_works():
        pytest.skip("bubblewrap missing or namespaces forbidden here")
    uv = subprocess.run([real_toolkit / "bin" / "uv", "--version"], capture_output=True, text=True)
    assert uv.stdout.split()[:2] == ["uv", OURS]
    # the host's root without /opt (the toolkit's mount point must be made in bwrap's own root)
    config = {"root": str(sandbox_root), "ro_binds": vt.sandbox_binds(real_toolkit),
              "host_paths": [path for path in HOST_PATHS if path != "/opt"]}
    spec = SandboxSpec(network=True, env=vt.sandbox_env(real_toolkit, SANDBOX_PATH))
    box = BwrapSandbox(spec, "verifier-tools", config)
    try:
        # any other URL still reaches the real curl (and PyPI through the sandbox's own network)
        probe = box.exec("curl -sS -o /dev/null -w '%{http_code}' https://pypi.org/simple/pytest/", timeout=60)
        assert probe.output.strip().endswith("200"), probe.output
        reward, cold_s, output = grade(box, PASSING)
        assert reward == "1", output
        assert "asked for uv 0.9.7" in output and f"installing uv {OURS}" in output
        assert "1 passed" in output
        summary = json.loads(box.read_file("/workspace/logs/verifier/ctrf.json"))["results"]["summary"]
        assert (summary["tests"], summary["passed"]) == (1, 1)  # pytest-json-ctrf's report
        reward, warm_s, output = grade(box, FAILING)
        assert reward == "0", output
        assert "1 failed" in output
        print(f"\ncookbook test.sh: {cold_s:.1f} s with an empty uv cache, {warm_s:.1f} s with it warm "
              f"(uv's cache: $HOME/.cache/uv = /workspace/.cache/uv)")
    finally:
        box.close()
