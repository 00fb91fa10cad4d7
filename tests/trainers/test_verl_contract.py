"""veRL's agent loop contract: the ``prorl`` loop, registered with veRL, called as veRL's rollout
worker calls it (no GPU, no Ray, a stub server manager), runs the sample through the whole
service (the fake LLM speaking SmolLM2's tokenizer) and returns an ``AgentLoopOutput`` whose ids,
mask, logprobs and reward are the service's own.

veRL lives in its own venv (scripts/install-trainers.sh verl: it pins a transformers older than
the project's); the loop runs there, in a subprocess, against this session's service.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import requests

from tests.conftest import ROOT

VENV = Path(os.environ.get("PRORL_VERL_VENV", Path.home() / ".cache/prorl-celery/verl-venv"))
PYTHON = VENV / "bin" / "python"
SCRIPT = [{"tool_calls": [{"name": "bash", "arguments": {"command": "echo forty-two"}}]},
          {"tool_calls": [{"name": "submit", "arguments": {"answer": "42"}}]}]


@pytest.fixture(scope="module")
def verl_python() -> Path:
    subprocess.run(["bash", str(ROOT / "scripts" / "install-trainers.sh"), "verl"], check=False, timeout=1200)
    probe = subprocess.run([str(PYTHON), "-c", "import verl.experimental.agent_loop"], capture_output=True,
                           text=True, timeout=300) if PYTHON.exists() else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"veRL is not importable in {VENV}: "
                    f"{probe.stderr.strip().splitlines()[-1] if probe and probe.stderr else 'no venv'}")
    return PYTHON


@pytest.fixture(scope="module")
def smol_tokenizer(tmp_path_factory) -> str:
    try:
        from prorl_celery.llm.llamacpp_server import save_tokenizer
        return str(save_tokenizer(tmp_path_factory.mktemp("smol-tokenizer")))
    except (ImportError, SystemExit, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2's tokenizer could not be made (scripts/install-real-llm.sh): {exc}")


@pytest.fixture
def fake_smol(stack, api, smol_tokenizer, tmp_path):
    """The fake LLM, scripted (a bash call, then submit 42), speaking SmolLM2's tokenizer, as the
    only backend; whatever was registered before is put back afterwards."""
    before = requests.get(f"{api}/llm_servers", timeout=10).json()["backends"]
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    url = stack.start_fake_llm(name="fake-verl", extra_args=["--policy", f"scripted:{script}", "--latency-model",
                                                             "none", "--tokenizer", smol_tokenizer])
    requests.post(f"{api}/clear_llm_server", timeout=10)
    resp = requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "generate", "dialect": "fake",
                                                     "tokenizer": smol_tokenizer, "weight_version": "v7"}, timeout=60)
    assert resp.status_code == 201, resp.text
    yield url
    requests.post(f"{api}/clear_llm_server", timeout=10)
    for backend in before:
        fields = {k: backend.get(k) for k in ("protocol", "dialect", "model", "tokenizer", "weight_version",
                                              "max_model_len", "capacity")}
        requests.post(f"{api}/llm_servers", json={"address": backend["address"], "probe": False,
                                                  **{k: v for k, v in fields.items() if v is not None}}, timeout=30)


def test_prorl_agent_loop_returns_the_services_trajectory(verl_python, stack, api, fake_smol, smol_tokenizer):
    row = {"raw_prompt": [{"role": "user", "content": "What is 6 * 7?"}], "data_source": "math",
           "reward_model": {"ground_truth": "42"}, "index": 0, "agent_name": "prorl"}
    args = {"tokenizer": smol_tokenizer, "response_length": 2048, "row": row,
            "config": str(ROOT / "examples" / "verl_agent_loop.yaml"),
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                                "logprobs": True}}
    env = {**os.environ, "PRORL_API_URL": api, "PRORL_API_TOKEN": stack.api_token}
    done = subprocess.run([str(verl_python), str(ROOT / "tests" / "trainers" / "verl_driver.py"), json.dumps(args)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    assert reply["registered"] == "prorl_celery.integrations.verl.ProrlAgentLoop"  # @register("prorl")
    assert reply["type"] == "verl.experimental.agent_loop.agent_loop.AgentLoopOutput"
    assert reply["server_manager_calls"] == 0
    out = reply["output"]
    job = requests.get(f"{api}/jobs/{out['extra_fields']['prorl_job_id']}", timeout=10).json()
    result, tokens = job["result"], job["result"]["tokens"]
    # the lengths veRL pads and masks with agree, and the values are the service's own
    assert len(out["response_ids"]) == len(out["response_mask"]) == len(out["response_logprobs"]) > 0
    assert out["prompt_ids"] == tokens["prompt_ids"] and out["response_ids"] == tokens["response_ids"]
    assert out["response_mask"] == tokens["loss_mask"] and out["response_logprobs"] == tokens["logprobs"]
    assert 0 in out["response_mask"] and 1 in out["response_mask"]  # the tool's output is masked out
    assert out["reward_score"] == result["reward"] == 1.0  # the service graded the submitted 42
    assert result["turns"] == 2 and out["extra_fields"]["assistant_turns"] == 2
    assert out["num_turns"] == 5  # user, assistant, tool, assistant, tool (the submit's reply)
    assert out["extra_fields"]["token_mode"] == "exact"
    assert out["extra_fields"]["weight_versions"] == ["v7", "v7"]
    assert out["metrics"]["generate_sequences"] == pytest.approx(result["timing"]["llm"])
