"""TRL's GRPO trains for real with the service's rollouts (``pytest -m trainer``): 3 optimizer
steps on SmolLM2-135M on the CPU, every rollout through the whole service (sandbox, agent loop,
grader), sampled by the trainer's own live weights served as a ``vllm-generate`` backend.

What it proves: the steps happened (gradient norm above zero, weights moved), every trajectory is
exact and carries the weight version of the step that sampled it, the versions advance with the
steps, and the ids and masks TRL built its loss from are, id for id, the service's.
"""
from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import pytest
import requests

from tests.conftest import ROOT

# The module's fixture trains for all 3 steps before its first test; ~150 s on a quiet node, several
# times that when other runs share the 2 cores (the default 300 s cut it off mid-step 3).
pytestmark = [pytest.mark.trainer, pytest.mark.timeout(1200)]
STEPS = 3


def _forget_torchless_transformers() -> None:
    """Drop a transformers imported before torch was installed: it decides once, at import, which
    backends exist, and collection imports it (tests/llm/test_hf_tokenizer.py) before this module's
    fixture installs torch on a fresh node; kept, it refuses to load any model for the session."""
    found = sys.modules.get("transformers.utils.import_utils")
    if found is None or found.is_torch_available():
        return
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture(scope="module")
def trl_installed():
    subprocess.run(["bash", str(ROOT / "scripts" / "install-trainers.sh"), "trl"], check=False, timeout=1800)
    _forget_torchless_transformers()
    from examples.trl_grpo import MODEL_DIR

    missing = [m for m in ("torch", "trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing or not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"scripts/install-trainers.sh could not install {missing or MODEL_DIR}")


@pytest.fixture(scope="module")
def run(trl_installed, stack, api, tmp_path_factory):
    from examples import trl_grpo
    from prorl_celery.client import ProrlClient

    before = requests.get(f"{api}/llm_servers", timeout=10).json()["backends"]
    requests.post(f"{api}/clear_llm_server", timeout=10)
    client = ProrlClient(stack.api_url, token=stack.api_token)
    grpo = trl_grpo.build(client, steps=STEPS, prompts=1, n=4, output_dir=str(tmp_path_factory.mktemp("grpo")))
    try:
        yield trl_grpo.train(grpo), client
    finally:
        grpo.server.stop()
        requests.post(f"{api}/clear_llm_server", timeout=10)
        for backend in before:
            requests.post(f"{api}/llm_servers", json={"address": backend["address"], "probe": False, **{
                k: backend[k] for k in ("protocol", "dialect", "tokenizer", "weight_version") if backend.get(k)}},
                timeout=30)


def test_optimizer_steps_moved_the_weights(run):
    grpo, _ = run
    from examples.trl_grpo import logs

    assert grpo.trainer.state.global_step == STEPS
    norms = [entry["grad_norm"] for entry in logs(grpo)]
    assert len(norms) == STEPS and max(norms) > 0, norms  # a group with unequal rewards gave a gradient
    moved = max((p.detach() - grpo.weights_before[name]).abs().max().item()
                for name, p in grpo.trainer.model.named_parameters())
    assert moved > 0
    advantages = [a for batch in grpo.batches for a in batch["advantages"]]
    assert any(a != 0 for a in advantages)  # from the service's rewards, the only reward function


def test_every_trajectory_exact_with_its_steps_weight_version(run):
    grpo, client = run
    history = grpo.rollout.history
    assert [h["weight_version"] for h in history] == [f"step{s}" for s in range(STEPS)]
    assert [h["step"] for h in history] == list(range(STEPS))
    for batch in history:
        assert len(batch["trajectories"]) == 4
        groups = {client.get(t.job_id)["group_id"] for t in batch["trajectories"]}
        assert len(groups) == 1  # TRL's 4 copies of the prompt: one group of the service
        for traj in batch["trajectories"]:
            view = client.get(traj.job_id)
            assert view["status"] == "completed" and view["result"]["token_mode"] == "exact"
            versions = [m["weight_version"] for m in view["result"]["messages"] if m["role"] == "assistant"]
            assert versions and set(versions) == {batch["weight_version"]}
    assert grpo.server.requests >= 4 * STEPS  # every turn was sampled by the live model


def test_trl_trained_on_the_services_ids(run):
    grpo, client = run
    assert len(grpo.batches) == STEPS
    for batch in grpo.batches:
        for row in batch["rows"]:
            tokens = client.get(row["job_id"])["result"]["tokens"]
            assert row["prompt_ids"] == tokens["prompt_ids"]
            assert row["completion_ids"] == tokens["response_ids"]
            assert row["mask"] == tokens["loss_mask"]


def test_live_model_server_samples_honestly(trl_installed):
    """The backend the service trains against: logprobs are the model's raw ones for the sampled
    ids, unseeded requests draw fresh samples, seeded ones repeat, and what it cannot honour is a
    400 naming the field (and no token, a 401)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.trl_grpo import MODEL_DIR
    from prorl_celery.integrations.serve import LiveModelServer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    server = LiveModelServer(model, tok).start()
    auth = {"Authorization": f"Bearer {server.api_key}"}
    prompt = tok.encode("The capital of France is")
    body = {"prompt": prompt, "max_tokens": 8, "logprobs": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True}

    def ask(**extra):
        resp = requests.post(f"{server.url}/v1/completions", json={**body, **extra}, headers=auth, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]
    try:
        first = ask()
        ids, logprobs = first["token_ids"], first["logprobs"]["token_logprobs"]
        assert first["logprobs"]["tokens"] == [f"token_id:{i}" for i in ids]
        with torch.no_grad():
            scores = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), dim=-1)
        rescored = [scores[len(prompt) - 1 + k, t].item() for k, t in enumerate(ids)]
        assert max(abs(a - b) for a, b in zip(rescored, logprobs)) < 1e-3
        assert len({tuple(ask()["token_ids"]) for _ in range(3)} | {tuple(ids)}) > 1
        assert ask(seed=3)["token_ids"] == ask(seed=3)["token_ids"]
        refused = requests.post(f"{server.url}/v1/completions", json={**body, "stop": ["."]}, headers=auth, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["field"] == "stop"
        assert requests.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 401
        wrong = requests.post(f"{server.url}/v1/completions", json=body, timeout=30,
                              headers={"Authorization": "Bearer \xe9t\xe9".encode("latin-1")})
        assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "missing or wrong bearer token"
    finally:
        server.stop()
