"""Checkouts without history from a local bare mirror (``file://``), in real bwrap sandboxes, and
the grader reading a test log far past the agent's 16,000-character observation."""
from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest

from prorl_celery.errors import PolicyDenied, SandboxError
from sandboxes.base import SandboxSpec
from tasks.swe import grader as swe_eval, repo
from tests.helpers import reachable_tmpdir
from tests.sandboxes.conftest import needs_bwrap

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, check=True, capture_output=True,
                          text=True).stdout.strip()


def commit_all(work: Path, message: str) -> str:
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", message)
    return git(work, "rev-parse", "HEAD")


@pytest.fixture
def worker_cache(tmp_path, monkeypatch):
    """The worker's mirrors and packs in tmp_path."""
    from config.settings import get_settings

    monkeypatch.setenv("PRORL_REPO_CACHE", str(tmp_path / "cache"))
    get_settings.cache_clear()
    yield tmp_path / "cache"
    get_settings.cache_clear()


@pytest.fixture
def history(tmp_path, worker_cache):
    """A repository whose history holds 2 MB that its base commit no longer has, a commit after
    the base, and a bare mirror of it."""
    work = tmp_path / "work"
    (work / "pkg").mkdir(parents=True)
    git(work, "init", "-q", "-b", "main")
    (work / "old.bin").write_bytes(os.urandom(2 * 1024 * 1024))
    (work / "pkg" / "__init__.py").write_text("VERSION = 1\n")
    big = commit_all(work, "old")
    (work / "old.bin").unlink()
    (work / "pkg" / "__init__.py").write_text("VERSION = 2\n")
    base = commit_all(work, "base")
    (work / "pkg" / "later.py").write_text("LATER = True\n")
    later = commit_all(work, "later")
    mirror = tmp_path / "mirror.git"
    subprocess.run(["git", "clone", "-q", "--mirror", str(work), str(mirror)], check=True, env=GIT_ENV)
    blob = git(work, "rev-parse", f"{big}:old.bin")
    return {"work": work, "mirror": mirror, "base": base, "later": later, "big_blob": blob}


@pytest.fixture
def sandbox_root():
    """A workspace root the sandboxes' own uids can reach (pytest's tmp_path is 0700)."""
    yield from reachable_tmpdir("prorl-test-swe-")


def _box(root: Path, name: str):
    from sandboxes.runtimes.bwrap import BwrapSandbox

    return BwrapSandbox(SandboxSpec(), name, {"root": str(root)})


def _old_way_bytes(path: Path) -> int:
    """What the previous checkout wrote into every sandbox: a tar of the whole repository."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(str(path), arcname=".")
    return len(buffer.getvalue())


@needs_bwrap()
def test_checkout_from_a_bare_mirror_by_file_url_has_the_commit_and_no_history(history, sandbox_root):
    instance = {"repo": "t/history", "repo_source": f"file://{history['mirror']}", "base_commit": history["base"]}
    box = _box(sandbox_root, "mirror-checkout")
    try:
        root = repo.checkout_into(box, instance, "repo")
        assert box.exec(f"cd {root} && git rev-parse HEAD").output.strip() == history["base"]
        assert box.exec(f"cd {root} && git rev-list --count HEAD").output.strip() == "1"
        assert box.exec(f"cd {root} && git status --porcelain").output.strip() == ""
        assert box.exec(f"cd {root} && cat pkg/__init__.py && ls pkg").output.split() == ["VERSION", "=", "2",
                                                                                         "__init__.py"]
        assert box.exec(f"cd {root} && git cat-file -e {history['big_blob']}").exit_code != 0
        # what the SWE handler does at the end of run, and the grader's reads of the base
        box.exec(f"cd {root} && echo 'VERSION = 3' > pkg/__init__.py && echo new > pkg/new.py")
        diff = box.exec(f"cd {root} && git add -A >/dev/null 2>&1; git diff --cached {history['base']} --binary")
        assert "+VERSION = 3" in diff.output and "pkg/new.py" in diff.output
        assert box.exec(f"cd {root} && git show {history['base']}:pkg/__init__.py").output.strip() == "VERSION = 2"
    finally:
        box.close()
    moved, before = repo.pack_bytes(instance), _old_way_bytes(history["mirror"])
    assert before > 2 * 1024 * 1024 and moved < 8192, (moved, before)


@needs_bwrap()
def test_a_work_tree_path_and_a_later_commit_of_the_same_mirror(history, sandbox_root):
    box = _box(sandbox_root, "worktree-checkout")
    try:
        later = {"repo": "t/history", "repo_source": str(history["mirror"]), "base_commit": history["later"]}
        root = repo.checkout_into(box, later, "a")
        assert box.exec(f"cat {root}/pkg/later.py").output.strip() == "LATER = True"
        base = {"repo": "t/history", "repo_source": str(history["work"]), "base_commit": history["base"]}
        root = repo.checkout_into(box, base, "b")
        assert box.exec(f"cd {root} && git rev-parse HEAD && ls pkg").output.split() == [history["base"], "__init__.py"]
    finally:
        box.close()


def test_concurrent_inits_pack_a_commit_once(history, monkeypatch):
    built = []
    real = repo.build_pack
    monkeypatch.setattr(repo, "build_pack", lambda *a: (built.append(a[1]), real(*a)))
    instance = {"repo": "t/history", "repo_source": f"file://{history['mirror']}", "base_commit": history["base"]}
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(repo.commit_pack(instance))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert built == [history["base"]] and len(set(paths)) == 1 and len(paths) == 4


def test_the_policy_holds_for_a_cached_commit_and_a_missing_commit_fails(history, tmp_path):
    allowed = {"repo": "t/history", "repo_source": f"file://{history['mirror']}", "base_commit": history["base"]}
    repo.commit_pack(allowed)
    for refused in ("file:///etc", "/root", f"http://127.0.0.1/{history['base']}.git"):
        with pytest.raises(PolicyDenied):
            repo.commit_pack({**allowed, "repo_source": refused})
    with pytest.raises(SandboxError, match="not in the repository"):
        repo.commit_pack({**allowed, "base_commit": "1" * 40})


def test_packs_past_the_budget_go_least_recently_used_first(tmp_path):
    packs = tmp_path / "packs"
    packs.mkdir()
    for age, name in enumerate(("old", "mid", "new")):
        path = packs / f"{name}.pack"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
    repo.evict_packs(packs, 2000, keep=packs / "old.pack")
    assert sorted(p.name for p in packs.glob("*.pack")) == ["new.pack", "old.pack"]


# -- the complete test log ----------------------------------------------------------------
LABELS = [f"case {i:03d} with a label long enough to fill a summary line" for i in range(400)]
TESTS = f'''import pytest

from calc.ops import double


@pytest.mark.parametrize("label", {LABELS!r})
def test_double(label):
    n = int(label.split()[1])
    assert double(n) == n + n
'''


def _sandbox_pytest() -> bool:
    found = subprocess.run(["/usr/bin/python3", "-c", "import pytest"], capture_output=True)
    return found.returncode == 0


@pytest.fixture
def long_log_instance(tmp_path):
    """A SWE instance whose test log is ~100 kB with the summary in the middle; the two failing
    tests sit in the middle of the summary; its test lists are JSON strings."""
    work = tmp_path / "longlog"
    (work / "calc").mkdir(parents=True)
    (work / "tests").mkdir()
    (work / "calc" / "__init__.py").write_text("")
    (work / "calc" / "ops.py").write_text("def double(n):\n    return n * 2 if n not in (200, 201) else n\n")
    (work / "tests" / "test_ops.py").write_text(TESTS)
    git(work, "init", "-q", "-b", "main")
    base = commit_all(work, "base")
    (work / "calc" / "ops.py").write_text("def double(n):\n    return n * 2\n")
    patch = subprocess.run(["git", "diff"], cwd=work, capture_output=True, text=True, check=True).stdout
    git(work, "checkout", "-q", "--", ".")
    ids = [f"tests/test_ops.py::test_double[{label}]" for label in LABELS]
    fail = [ids[200], ids[201]]
    noise = "python3 -c \"print('output after the summary ' * 2000)\""
    return {"repo": "t/longlog", "repo_source": str(work), "base_commit": base, "test_patch": "",
            "FAIL_TO_PASS": json.dumps(fail), "PASS_TO_PASS": json.dumps([i for i in ids if i not in fail]),
            "test_cmd": f"{noise}; python3 -m pytest -rA -p no:cacheprovider tests; {noise}",
            "patch": patch}


@needs_bwrap()
@pytest.mark.skipif(not _sandbox_pytest(), reason="the system Python has no pytest "
                    "(scripts/install-system-deps.sh installs python3-pytest)")
def test_grader_reads_the_whole_log_the_agent_sees_cut(long_log_instance, sandbox_root, worker_cache):
    instance = long_log_instance
    box = _box(sandbox_root, "long-log")
    try:
        view = repo.checkout_into(box, instance, "view")  # what the agent sees of the same run
        seen = box.exec(f"(cd {view} && {instance['test_cmd']})", timeout=300)
        summary = [line for line in seen.output.splitlines() if line.startswith(("PASSED ", "FAILED "))]
        assert seen.truncated and not [line for line in summary if "case 20" in line]  # the agent lost the middle
        root = repo.checkout_into(box, instance, "repo")
        result = swe_eval.grade(box, root, instance, instance["patch"], 300)
    finally:
        box.close()
    report = result["eval"]
    assert "log_bytes" in report, report
    assert report["log_bytes"] > 100_000 and report["log_chars_read"] == report["log_bytes"], report["log_bytes"]
    assert result["resolved"] is True and result["reward"] == 1.0, {k: v for k, v in report.items() if k != "PASS_TO_PASS"}
    assert set(report["PASS_TO_PASS"].values()) == {"PASSED"} and len(report["PASS_TO_PASS"]) == 398


@needs_bwrap()
def test_a_log_past_the_cap_keeps_head_and_tail(sandbox_root):
    box = _box(sandbox_root, "log-cap")
    try:
        box.exec("{ echo FIRST; head -c 100000 /dev/zero | tr '\\0' x; echo; echo LAST; } > big.log")
        path = box.exec("pwd").output.strip() + "/big.log"
        text, size = swe_eval.read_log(box, path, cap=20_000)
    finally:
        box.close()
    assert size == 100_012 and text.startswith("FIRST") and text.rstrip().endswith("LAST")
    assert len(text) < 20_100 and "bytes of the log cut here" in text


@needs_bwrap()
def test_a_test_patch_in_the_middle_of_a_large_tree_applies(tmp_path, sandbox_root, worker_cache):
    """The grader lists the base tree to reset the tests: 900 test files (~50 kB of names, far past
    the output limit) and a test patch that changes one in the middle of the listing."""
    work = tmp_path / "bigtree"
    (work / "tests").mkdir(parents=True)
    (work / "tests" / "__init__.py").write_text("")
    (work / "lib.py").write_text("def value():\n    return 1\n")
    for i in range(900):
        (work / "tests" / f"test_module_{i:03d}_with_a_name_long_enough.py").write_text(
            "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n")
    git(work, "init", "-q", "-b", "main")
    base = commit_all(work, "base")
    middle = work / "tests" / "test_module_450_with_a_name_long_enough.py"
    middle.write_text(middle.read_text() + "\n    def test_value(self):\n        import lib\n"
                      "        self.assertEqual(lib.value(), 2)\n")
    test_patch = subprocess.run(["git", "diff"], cwd=work, capture_output=True, text=True, check=True).stdout
    git(work, "checkout", "-q", "--", ".")
    (work / "lib.py").write_text("def value():\n    return 2\n")
    patch = subprocess.run(["git", "diff"], cwd=work, capture_output=True, text=True, check=True).stdout
    git(work, "checkout", "-q", "--", ".")
    name = "tests.test_module_450_with_a_name_long_enough.T"
    instance = {"repo": "t/bigtree", "repo_source": str(work), "base_commit": base, "test_patch": test_patch,
                "FAIL_TO_PASS": [f"{name}.test_value"], "PASS_TO_PASS": [f"{name}.test_ok"],
                "test_cmd": "python3 -m unittest -v tests.test_module_450_with_a_name_long_enough"}
    box = _box(sandbox_root, "big-tree")
    try:
        root = repo.checkout_into(box, instance, "repo")
        listing = box.exec(f"cd {root} && git ls-tree -r --name-only {base}")
        assert listing.truncated  # what the grader read before, and lost the middle of
        result = swe_eval.grade(box, root, instance, patch, 300)
    finally:
        box.close()
    assert result["eval"]["applied"] == {"model_patch": True, "test_patch": True}, result["eval"]
    assert result["resolved"] is True and result["reward"] == 1.0, result["eval"]
