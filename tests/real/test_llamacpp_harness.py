"""Real mini-swe-agent against real llama.cpp (SmolLM2-135M, token mode through the session
gateway), seen through a logging proxy: each recorded call's prompt ids are what the server's own
``/tokenize`` makes of the rendered template, its response ids are what the server returned, and
there is one logprob per token on every call. The tiny model rarely writes a valid tool call, so
mini-swe-agent mostly answers format errors: what is checked is the tokens, not the task. Real
llama.cpp is the default suite's (scripts/install-real-llm.sh)."""
from __future__ import annotations

from pathlib import Path

import pytest
import requests

from prorl_celery.rollout.segments import prompts
from prorl_celery.rollout.store import RolloutStore
from tasks.harnesses.mini_swe_agent import mini_binary
from tests.conftest import submit, wait
from tests.real.test_llamacpp import _detokenize, _register, recorder  # noqa: F401 - fixture

pytestmark = pytest.mark.skipif(not Path(mini_binary()).is_absolute(), reason="mini-swe-agent is not installed "
                                "for sandboxes (bash scripts/install-harnesses.sh)")


def test_mini_swe_agent_on_llamacpp_is_token_exact(api, redis_client, llamacpp, recorder, smol_tokenizer):
    _register(api, address=recorder.url, protocol="generate", dialect="llama.cpp", tokenizer=smol_tokenizer,
              exact_tokens=True)
    before = len(recorder.posts("/completion"))
    instance = {"data_source": "math", "problem": "What is 2 + 3?", "answer": "5",
                "agent": {"harness": "mini_swe_agent", "max_calls": 3, "wall_s": 240}}
    view = wait(api, submit(api, instance, sampling_params={"max_tokens": 16, "seed": 3}), timeout=300)
    assert view["status"] == "completed", view["result"]
    result = view["result"]
    records = RolloutStore(redis_client).read(result["job_id"])  # the job's rollout, as the built-in agent's
    wire = recorder.posts("/completion")[before:]
    assert len(records) == len(wire) == result["turns"] >= 2, result["harness"]["output"][-2000:]
    assert [body["prompt"] for body, _ in wire] == prompts(records)
    assert [[int(i) for i in got["tokens"]] for _, got in wire] == [r.response_ids for r in records]
    assert all(len(r.logprobs) == len(r.response_ids) > 0 for r in records)
    assert all(body["n_predict"] == 16 for body, _ in wire)  # the trainer's sampling, not the harness's
    first = prompts(records)[0]  # the gateway's render is the server's own tokenisation of that text
    text = _detokenize(llamacpp, first)
    server = requests.post(f"{llamacpp}/tokenize", json={"content": text, "parse_special": True}, timeout=10)
    assert server.json()["tokens"] == first
    # mini-swe-agent drops an answer it could not parse from its history (it keeps only the format
    # error), so such a call does not continue the last one: a new segment, its prompt still stored
    # as the ids past what the last call held; no answer of the model is rendered from text again
    # (the dropped one is gone, the kept ones are continued): no call re-tokenised a generated turn
    assert all(r.keep > 0 for r in records[1:])
    counts = result["harness"]["counts"]
    assert counts["retokenized_calls"] == 0 and all(r.meta["gateway"]["retokenized"] == 0 for r in records)
    assert counts["segments"] == 1 + sum(s["reason"] == "not_a_prefix" for s in result["harness"]["segments"])
