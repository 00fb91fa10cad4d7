"""Real SWE-bench rows resolve through the whole service, each in the environment built from its
recipe (tests/fixtures/swebench: rows from public SWE-bench data, their repositories at
base_commit, recipes from swebench's specs).

A stack of its own (its own Redis; its sandbox host's image directory is the environment cache),
the scripted agents of :mod:`tests.real.swebench_policy` behind the fake LLM server, HTTP
submissions. For every instance: the gold patch resolves with every listed test PASSED, the
empty patch and a no-op patch do not. The first run builds the environments (about a minute or
two each, pip from PyPI) into the environment cache; later runs find them there.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import requests

from tests.conftest import TEST_ENV, submit, wait
from tests.real import swebench_data
from tests.real.swebench_policy import EMPTY, NOOP

INSTANCES = ["pytest-dev__pytest-11143", "sqlfluff__sqlfluff-2386", "marshmallow-code__marshmallow-1359"]
LONG_LOG = "pytest-dev__pytest-11143"  # parametrized ids with spaces, a test log of ~70,000 characters
ORACLE = ["--policy", "oracle:tests.real.swebench_policy:reply", "--latency-model", "none"]
RECIPES = swebench_data.HERE / "recipes"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def recipe_of(instance_id: str, repo: Path):
    from sandboxes.runtimes.envbuild import EnvRecipe, RepoAt

    recipe = EnvRecipe.model_validate_json((RECIPES / f"{instance_id}.json").read_text())
    return recipe.model_copy(update={"repo": RepoAt(source=str(repo), commit=recipe.repo.commit)})


@pytest.fixture(scope="module")
def instances(tmp_path_factory) -> dict[str, dict]:
    """Each row as a SWE instance: its repository rebuilt at base_commit, its environment built
    (or found in the cache) on this node."""
    from sandboxes.runtimes.envbuild import ensure_env

    out = {}
    for instance_id in INSTANCES:
        row = swebench_data.rows()[instance_id]
        repo = swebench_data.materialize(row, tmp_path_factory.mktemp("swebench") / instance_id)
        image = ensure_env(recipe_of(instance_id, repo))
        out[instance_id] = {**row, "data_source": "swebench", "repo_source": str(repo), "image": str(image)}
    return out


@pytest.fixture(scope="module")
def service(instances, tmp_path_factory):
    from prorl_celery.launcher import Stack, StackOptions
    from sandboxes.runtimes.envbuild import env_dir

    env = {**TEST_ENV, "PRORL_SANDBOX_IMAGE_DIRS": str(env_dir()), "PRORL_ENV_DIR": str(env_dir())}
    options = StackOptions(state_dir=tmp_path_factory.mktemp("swebench-stack"), persist=False, env=env,
                           concurrency={"init": 3, "run": 3, "eval": 3, "maint": 1})
    with Stack(options) as stack:
        yield stack


def _use_llm(stack, tmp_path: Path, name: str, script: list | None = None) -> None:
    """Make ``name`` (the oracle, or a scripted policy) the one LLM backend of the stack."""
    api = stack.api_url
    requests.post(f"{api}/clear_llm_server", timeout=10)
    if script is None:
        args = ORACLE
    else:
        (tmp_path / f"{name}.json").write_text(json.dumps(script))
        args = ["--policy", f"scripted:{tmp_path / f'{name}.json'}", "--latency-model", "none"]
    url = stack.start_fake_llm(name=name, extra_args=args)
    resp = requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "chat"}, timeout=10)
    assert resp.status_code == 201, resp.text


def _run_all(stack, instances: dict[str, dict]) -> dict[str, dict]:
    jobs = {iid: submit(stack.api_url, instance) for iid, instance in instances.items()}
    views = {iid: wait(stack.api_url, job, timeout=900) for iid, job in jobs.items()}
    for iid, view in views.items():
        assert view["status"] == "completed", (iid, view["result"])
    return {iid: view["result"] for iid, view in views.items()}


def _listed(instance: dict, field: str) -> list[str]:
    value = instance[field]
    return json.loads(value) if isinstance(value, str) else list(value)


def test_gold_patches_resolve_every_listed_test(service, instances, tmp_path):
    _use_llm(service, tmp_path, "swebench-oracle")
    results = _run_all(service, instances)
    for iid, result in results.items():
        instance = instances[iid]
        assert result["sandbox"]["image"] == instance["image"] or instance["image"] in json.dumps(result["sandbox"]), result["sandbox"]
        assert result["resolved"] is True and result["reward"] == 1.0, (iid, result["eval"])
        assert result["eval"]["FAIL_TO_PASS"] == {t: "PASSED" for t in _listed(instance, "FAIL_TO_PASS")}, iid
        assert result["eval"]["PASS_TO_PASS"] == {t: "PASSED" for t in _listed(instance, "PASS_TO_PASS")}, iid
        changed = {line[6:] for line in result["git_patch"].splitlines() if line.startswith("+++ b/")}
        assert changed == {line[6:] for line in instance["patch"].splitlines() if line.startswith("+++ b/")}
    long = results[LONG_LOG]["eval"]
    assert long["log_bytes"] > 16000 and long["log_chars_read"] > 16000, long.get("log_bytes")
    spaced = [t for t in _listed(instances[LONG_LOG], "PASS_TO_PASS") if "test_get_assertion_exprs[" in t]
    assert len(spaced) >= 10 and all(long["PASS_TO_PASS"][t] == "PASSED" for t in spaced)
    assert any("\n" in t or "[\\n" in t for t in _listed(instances["sqlfluff__sqlfluff-2386"], "PASS_TO_PASS"))


def test_empty_patches_do_not_resolve(service, instances, tmp_path):
    _use_llm(service, tmp_path, "swebench-empty", EMPTY)
    for iid, result in _run_all(service, instances).items():
        assert result["resolved"] is False and result["reward"] == 0.0, iid
        assert result["git_patch"] == "" and result["eval"] == {"skipped": "empty patch"}, iid


def test_noop_patches_do_not_resolve(service, instances, tmp_path):
    _use_llm(service, tmp_path, "swebench-noop", NOOP)
    for iid, result in _run_all(service, instances).items():
        instance = instances[iid]
        assert result["git_patch"].count("+# prorl: a comment, nothing else") == 1, (iid, result["git_patch"][:500])
        assert result["resolved"] is False and result["reward"] == 0.0, (iid, result["eval"])
        f2p = result["eval"]["FAIL_TO_PASS"]
        assert set(f2p) == set(_listed(instance, "FAIL_TO_PASS")) and "PASSED" not in f2p.values(), (iid, f2p)
        assert "MISSING" not in f2p.values() or iid == "sqlfluff__sqlfluff-2386", (iid, f2p)
        p2p = result["eval"]["PASS_TO_PASS"]
        assert p2p == {t: "PASSED" for t in _listed(instance, "PASS_TO_PASS")}, (iid, p2p)
