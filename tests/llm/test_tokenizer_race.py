"""The tokenizer is loaded once per process, however many threads ask for it at the same moment
(issue 15, item 4): on a fresh worker every ``run`` thread of the first token-mode jobs asks at
once, and with an ``lru_cache`` each built its own while their concurrent first imports of
``transformers`` failed the losers as "needs the optional 'transformers' package"."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import requests

from prorl_celery.errors import InvalidRequest, UnknownPlugin
from prorl_celery.llm import tokenizer as tokmod
from tests.conftest import ROOT, submit, wait

if not all(importlib.util.find_spec(name) for name in ("transformers", "tokenizers")):  # found, not imported
    pytest.skip("the optional 'transformers' package is not installed", allow_module_level=True)

from tests.llm.test_hf_tokenizer import TEMPLATE, build_tokenizer  # noqa: E402 - after the skips

THREADS = 24
RACE = textwrap.dedent("""
    import sys, threading
    from prorl_celery.llm import tokenizer
    built = []
    original = tokenizer.HFTokenizer.__init__
    def counting(self, name):
        built.append(name)
        original(self, name)
    tokenizer.HFTokenizer.__init__ = counting
    barrier = threading.Barrier({threads})
    got, errors = [], []
    def ask():
        barrier.wait()
        try:
            got.append(id(tokenizer.get_tokenizer(sys.argv[1])))
        except Exception as exc:
            errors.append(f"{{type(exc).__name__}}: {{exc}}")
    threads = [threading.Thread(target=ask) for _ in range({threads})]
    for t in threads: t.start()
    for t in threads: t.join()
    import json; print(json.dumps({{"got": len(got), "distinct": len(set(got)), "built": len(built),
                                    "errors": errors[:3]}}))
""").format(threads=THREADS)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("race-tok") / "tok", TEMPLATE)


def test_threads_of_a_fresh_interpreter_share_one_load(hf_dir):
    """A fresh interpreter (transformers not yet imported), 24 threads released together: all get
    the same tokenizer object, built once, and none fails."""
    proc = subprocess.run([sys.executable, "-c", RACE, str(hf_dir)], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                                                      "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"got": THREADS, "distinct": 1, "built": 1, "errors": []}


def test_a_loading_error_says_what_happened(tmp_path, monkeypatch):
    """A directory that is no tokenizer: the real cause, naming the field, not "needs the
    optional 'transformers' package"; and nothing is cached, so a fixed directory loads."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(tokmod, "LOAD_BACKOFF_S", 0.01)
    missing = tmp_path / "no-such-tokenizer"
    missing.mkdir()
    with pytest.raises(InvalidRequest) as info:
        tokmod.get_tokenizer(str(missing))
    assert info.value.field == "tokenizer" and "optional" not in str(info.value)
    assert str(missing) in str(info.value)
    build_tokenizer(missing, TEMPLATE)
    assert tokmod.get_tokenizer(str(missing)).encode("<|im_end|>")


@pytest.mark.unit
def test_a_transient_import_error_is_retried(monkeypatch, tmp_path):
    """An ImportError that is not the package missing (a half-initialised module) passes on the
    next attempt; a missing package is reported as missing, at once."""
    monkeypatch.setattr(tokmod, "LOAD_BACKOFF_S", 0.01)
    calls = []

    class Flaky:
        def __init__(self, name):
            calls.append(name)
            if len(calls) == 1:
                raise ImportError("cannot import name 'AutoTokenizer' from partially initialized module")
            self.stop_ids = frozenset()

    monkeypatch.setattr(tokmod, "HFTokenizer", Flaky)
    name = str(tmp_path / "flaky")
    assert isinstance(tokmod.get_tokenizer(name), Flaky) and len(calls) == 2

    def absent(name):
        raise UnknownPlugin(f"tokenizer {name!r} needs the optional 'transformers' package")

    monkeypatch.setattr(tokmod, "HFTokenizer", absent)
    with pytest.raises(UnknownPlugin):
        tokmod.get_tokenizer(str(tmp_path / "absent"))


def _fresh_run_worker(stack) -> None:
    """Replace the stack's ``run`` worker by a new process: nothing loaded in it yet."""
    stack.pause_supervision("worker-run")
    try:
        stack.children["worker-run"].stop(grace_s=10.0)
        stack.start_worker("run")
    finally:
        stack._paused.discard("worker-run")
    stack.wait_for_workers(["run"])


@pytest.mark.slow  # ~14 s: a fresh run worker and eight token-mode rollouts
def test_many_token_mode_rollouts_at_once_on_a_fresh_worker(stack, api, hf_dir, tmp_path):
    """8 token-mode jobs submitted together to a worker that has loaded no tokenizer (8 run
    threads): every one completes, exact."""
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"tool_calls": [{"name": "submit", "arguments": {"answer": "7"}}]}]))
    requests.post(f"{api}/clear_llm_server", timeout=120)
    url = stack.start_fake_llm(name="fake-race", extra_args=["--policy", f"scripted:{script}",
                                                             "--latency-model", "none", "--tokenizer", str(hf_dir)])
    resp = requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "generate", "dialect": "fake",
                                                     "tokenizer": str(hf_dir)}, timeout=120)
    assert resp.status_code == 201, resp.text
    try:
        _fresh_run_worker(stack)
        jobs = [submit(api, {"data_source": "math", "problem": f"Answer 7 ({i}).", "answer": "7"},
                       sampling_params={"token_level_generation": True}) for i in range(8)]
        results = [wait(api, job, timeout=600) for job in jobs]
        assert [r["status"] for r in results] == ["completed"] * 8, [r["result"].get("error") for r in results]
        assert all(r["result"]["token_mode"] == "exact" for r in results)
    finally:
        requests.post(f"{api}/clear_llm_server", timeout=120)
        stack.children["fake-race"].stop(grace_s=5.0)
