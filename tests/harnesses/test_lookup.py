"""The ``lookup`` task (tasks/handlers/lookup.py) through examples/lookup_agent.py, a black-box
harness of an ordinary OpenAI client (installed for sandboxes by scripts/install-harnesses.sh
openai-client): two calls through the gateway, the file the model chose shown between them. The
reward follows the observation (the named file's code earns 1, a decoy's 0), and the trajectory
is one sequence whose observation ids have loss mask 0 — what a trainer of the harness gets."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from tests.conftest import submit, wait

PYTHON = Path("/opt/prorl-harnesses/openai-client/bin/python")
AGENT = {"harness": "command", "max_calls": 2, "wall_s": 120,
         "command": f"{PYTHON} {PYTHON.parent.parent / 'lookup_agent.py'}"}
pytestmark = pytest.mark.skipif(not (PYTHON.parent.parent / "lookup_agent.py").is_file(),
                                reason="bash scripts/install-harnesses.sh openai-client")
FILES = {"a.txt": "the code is 31337\n", "b.txt": "the code is 48213\n", "c.txt": "the code is 70451\n"}


def instance() -> dict:
    return {"data_source": "lookup", "files": FILES, "target": "b.txt", "code": "48213", "agent": AGENT}


@pytest.fixture(scope="module")
def backends(stack, api, tmp_path_factory):
    """The oracle (it opens the named file and reads its code back) and a script that opens c.txt."""
    requests.post(f"{api}/clear_llm_server", timeout=10)
    script = tmp_path_factory.mktemp("lookup") / "wrong.json"
    script.write_text(json.dumps(["c.txt", "70451"]))
    urls = {"oracle": stack.start_fake_llm(name="fake-lookup-oracle", extra_args=[
                "--policy", "oracle:prorl_celery.fakes.harness_oracle:reply", "--latency-model", "none"]),
            "wrong": stack.start_fake_llm(name="fake-lookup-wrong", extra_args=[
                "--policy", f"scripted:{script}", "--latency-model", "none"])}
    yield urls
    requests.post(f"{api}/clear_llm_server", timeout=10)


def _only(api: str, url: str) -> None:
    requests.post(f"{api}/clear_llm_server", timeout=10)
    resp = requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "generate", "dialect": "fake"},
                         timeout=10)
    assert resp.status_code == 201, resp.text


def test_the_reward_follows_what_the_observation_said_and_the_observation_is_masked(api, backends):
    _only(api, backends["oracle"])
    view = wait(api, submit(api, instance()), timeout=180)
    result = view["result"]
    assert view["status"] == "completed" and result["reward"] == 1.0, result.get("eval") or result.get("harness")
    assert result["turns"] == 2 and result["token_mode"] == "exact" and result["harness"]["counts"]["segments"] == 1
    tokens, calls = result["tokens"], [m for m in result["messages"] if m["role"] == "assistant" and not m.get("resent")]
    assert [c["content"] for c in calls] == ["b.txt", "48213"]
    # the ids between the two answers (the observation, "b.txt says: ...") are not trained on
    first = len(calls[0]["token_ids"])
    between = tokens["loss_mask"][first:len(tokens["loss_mask"]) - len(calls[1]["token_ids"])]
    assert between and set(between) == {0} and tokens["loss_mask"][:first] == [1] * first
    assert sum(tokens["loss_mask"]) == sum(len(c["token_ids"]) for c in calls)
    observation = [m for m in result["messages"] if m["role"] == "user"][-1]["content"]
    assert "b.txt says:" in observation and "48213" in observation

    _only(api, backends["wrong"])
    view = wait(api, submit(api, instance()), timeout=180)
    assert view["status"] == "completed" and view["result"]["reward"] == 0.0
    assert view["result"]["eval"]["decoy"] == ["c.txt"]
