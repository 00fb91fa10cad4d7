"""NeMo RL through NeMo Gym: the contract of Gym's ``prorl_agent`` agent server (NeMo Gym PR 1290,
``responses_api_agents/prorl_agent/run_prorl.py``) driven against a stand-in for Gym's model server.

Gym's side, as read from its code:
- the agent server calls ``POST /start`` (400 = already running), ``POST /add_llm_server
  {"address": "http://<model server>/v1"}``, then one ``POST /process {instance, sampling_params:
  {temperature, top_p, max_output_tokens}, job_id}`` per task; it reads ``messages, tools, resolved,
  success, git_patch, critical_error, end_properly, filter, error``; per assistant message
  ``input_ids`` -> ``prompt_token_ids``, ``token_ids`` -> ``generation_token_ids``, ``logprobs`` ->
  ``generation_log_probs``, and flat ``tool_calls [{"name", "arguments"}]``; a tool message's
  ``tool_call_id`` (optional) must be one of Gym's own call ids, else it pairs in order.
- Gym's model server (``responses_api_models/vllm_model/app.py``) answers ``POST /v1/chat/completions``
  with the bundle on the message (``prompt_token_ids``, ``generation_token_ids``,
  ``generation_log_probs``), removes vLLM's ``choice.logprobs``, ``choice.token_ids`` and top-level
  ``prompt_token_ids``, ignores request fields it does not know, and has no ``GET /v1/models``.
- NeMo RL (``nemo_rl/environments/nemo_gym.py``) asserts that every trainable item's
  ``prompt_token_ids`` starts with all earlier prompt + generation ids; its vLLM builds the next
  prompt from the last assistant message's ``prompt_token_ids + generation_token_ids`` in the
  history (``required_prefix_token_ids``). The stand-in does the same, and re-renders the history
  (differently from what was generated, as a real template does) when that message carries none.
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import types
from typing import Any

import pytest
import requests
from flask import Flask, jsonify, request
from werkzeug.serving import make_server

from prorl_celery.integrations.nemo_gym import GYM_MODULES, patch_prorl_agent
from prorl_celery.fakes import swe

IM_START, IM_END = 1, 2
ROLES = {"system": 3, "user": 4, "assistant": 5, "tool": 6}


def _text_ids(text: str) -> list[int]:
    return [16 + b for b in text.encode()]


def _render(message: dict[str, Any]) -> list[int]:
    """How the stand-in's chat template renders a message of the history."""
    body = message.get("content") or ""
    if message.get("tool_calls"):  # the template re-renders calls its own way (not as generated)
        body += json.dumps([c["function"] for c in message["tool_calls"]], sort_keys=True)
    return [IM_START, ROLES[message["role"]], *_text_ids(body), IM_END]


def _prompt(messages: list[dict[str, Any]]) -> list[int]:
    """NeMo RL's vLLM: the last assistant message's ids, if it has them, then the rest rendered."""
    start, ids = 0, []
    for i in range(len(messages) - 1, -1, -1):
        if "prompt_token_ids" in messages[i]:
            ids = list(messages[i]["prompt_token_ids"]) + list(messages[i]["generation_token_ids"])
            start = i + 1
            break
    for message in messages[start:]:
        ids += _render(message)
    return ids + [IM_START, ROLES["assistant"]]


class GymModelServer:
    """A stand-in shaped like NeMo Gym's ``vllm_model`` server with ``return_token_id_information``."""

    def __init__(self, script: list[dict[str, Any]]):
        self.script, self.requests, self.replies = script, [], []
        self.app = Flask("gym-model-server")
        self.app.add_url_rule("/", "live", lambda: jsonify({"status": "ok"}))
        self.app.add_url_rule("/v1/chat/completions", "chat", self._chat, methods=["POST"])
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _chat(self):
        body = request.get_json()
        if not isinstance(body.get("messages"), list) or body.get("stream"):
            return jsonify({"detail": "messages required; no streaming"}), 422
        self.requests.append(body)
        prompt = _prompt(body["messages"])
        if body.get("max_tokens") == 1:  # a registration probe: one token, no tool call
            step: dict[str, Any] = {"content": "o"}
        else:
            step = self.script[sum(m["role"] == "assistant" for m in body["messages"])]
        calls = [{"id": f"chatcmpl-tool-{len(self.requests)}-{i}", "type": "function",
                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                 for i, c in enumerate(step.get("tool_calls", []))]
        raw = (step.get("content") or "") + "".join(f"<tool_call>{json.dumps(c['function'])}</tool_call>"
                                                    for c in calls)
        generated = (_text_ids(raw) + [IM_END])[: body.get("max_tokens") or None]
        logprobs = [-round(0.01 * (k + 1), 4) for k in range(len(generated))]
        message = {"role": "assistant", "content": step.get("content"), "tool_calls": calls or None,
                   "prompt_token_ids": prompt, "generation_token_ids": generated,
                   "generation_log_probs": logprobs}
        self.replies.append(message)
        return jsonify({"id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": 0,
                        "model": "policy", "choices": [{"index": 0, "message": message, "logprobs": None,
                                                        "finish_reason": "tool_calls" if calls else "stop"}],
                        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(generated),
                                  "total_tokens": len(prompt) + len(generated)}})

    def __enter__(self) -> "GymModelServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()


def _episode(gold_patch: str) -> list[dict[str, Any]]:
    """Two bash calls (apply the fix, look at it), then submit."""
    apply = f"git apply <<'PATCH_EOF'\n{gold_patch}PATCH_EOF"
    return [{"content": "I will apply the fix.", "tool_calls": [{"name": "bash", "arguments": {"command": apply}}]},
            {"content": None, "tool_calls": [{"name": "bash", "arguments": {"command": "git status --short"}}]},
            {"content": "Done.", "tool_calls": [{"name": "submit", "arguments": {}}]}]


def nemo_rl_prefix_check(messages: list[dict[str, Any]]) -> int:
    """NeMo RL's check, on what Gym's converter makes of our messages; returns the trainable turns."""
    seen: list[int] = []
    trainable = 0
    for m in messages:
        if m["role"] != "assistant" or not m.get("token_ids"):  # Gym: token_ids -> generation_token_ids
            continue
        prompt = m["input_ids"]  # Gym: input_ids -> prompt_token_ids
        assert prompt[: len(seen)] == seen, f"turn {trainable}: prompt does not extend the earlier tokens"
        seen = prompt + m["token_ids"]
        trainable += 1
    return trainable


def gym_pairs(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Gym's pairing of tool results with calls (call_<n> numbered by Gym, oldest first)."""
    pending, pairs, counter = [], [], 0
    for m in messages:
        if m["role"] == "assistant":
            for call in m["tool_calls"]:
                counter += 1
                pending.append((f"call_{counter}", call["name"]))
        elif m["role"] == "tool":
            given = m.get("tool_call_id")
            assert given is None or given in [p[0] for p in pending], "a tool_call_id Gym cannot pair"
            pairs.append(pending.pop(0))
    return pairs


@pytest.fixture
def only_the_standin(api):
    requests.post(f"{api}/clear_llm_server", timeout=10)
    yield
    requests.post(f"{api}/clear_llm_server", timeout=10)
    requests.post(f"{api}/stop", timeout=30)


def test_probe_accepts_a_gym_model_server(api, only_the_standin):
    """Registration with the probe (tools and exact ids asked for) accepts Gym's model server,
    which has no GET /v1/models and reports its ids on the message."""
    with GymModelServer([]) as gym:
        resp = requests.post(f"{api}/llm_servers", json={"address": f"{gym.url}/v1", "dialect": "nemo-gym",
                                                         "tools": True, "exact_tokens": True}, timeout=30)
        assert resp.status_code == 201, resp.text
        assert resp.json()["backend"]["dialect"] == "nemo-gym"
        assert gym.requests and gym.requests[-1]["max_tokens"] == 1


@pytest.fixture
def gym_agent(monkeypatch):
    """Gym's prorl_agent modules (stand-ins: Gym is not installed here), for patch_prorl_agent."""
    for name in GYM_MODULES:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    return sys.modules[GYM_MODULES[-1]]


def test_patched_gym_calls_carry_the_token_and_raise_when_refused(api, stack, gym_agent):
    assert patch_prorl_agent("wrong-token") == list(GYM_MODULES)
    with pytest.raises(requests.HTTPError) as refused:
        gym_agent.initialize_prorl_server(api, "http://127.0.0.1:9/v1")
    assert refused.value.response.status_code == 401  # the token sent is ours, and a refusal is loud


def test_process_meets_nemo_gym_prorl_agent_contract(api, stack, only_the_standin, gym_agent, tmp_path):
    instance = swe.build("statkit", tmp_path / "repos")
    patch_prorl_agent(stack.api_token)
    with GymModelServer(_episode(instance["patch"])) as gym:
        # Gym's model_post_init: /start (400 if running is fine), /add_llm_server with http://host:port/v1
        gym_agent.initialize_prorl_server(api, f"{gym.url}/v1")
        listed = requests.get(f"{api}/llm_servers", timeout=10).json()["backends"]
        assert [b["dialect"] for b in listed] == ["nemo-gym"]
        assert [body["max_tokens"] for body in gym.requests] == [1]  # the registration probe
        del gym.requests[:], gym.replies[:]
        # Gym's _run_with_prorl: the instance dict, three sampling params, the instance id as job id
        result = asyncio.run(gym_agent.call_prorl_process(
            api, instance, {"temperature": 1.0, "top_p": 1.0, "max_output_tokens": 4096},
            job_id=f"gym-{tmp_path.name}", timeout_seconds=400))

    # the fields Gym reads, with the types it treats them as
    assert result["resolved"] is True and result["success"] is True, result.get("eval")
    assert result["end_properly"] is True and result["filter"] is False
    assert result["critical_error"] is None and result["error"] is None
    assert "statkit/" in result["git_patch"]
    assert {t["function"]["name"] for t in result["tools"]} == {"bash", "str_replace_editor", "submit"}
    assert all(t["type"] == "function" and "parameters" in t["function"] for t in result["tools"])

    messages = result["messages"]
    assistant = [m for m in messages if m["role"] == "assistant"]
    assert len(assistant) == 3 == len(gym.replies)
    # flat tool calls, as Gym's converter reads them (name, arguments); our id rides along
    assert [[c["name"] for c in m["tool_calls"]] for m in assistant] == [["bash"], ["bash"], ["submit"]]
    assert all(set(c) <= {"name", "arguments", "id"} and isinstance(c["arguments"], str)
               for m in assistant for c in m["tool_calls"])
    assert json.loads(assistant[1]["tool_calls"][0]["arguments"]) == {"command": "git status --short"}
    assert gym_pairs(messages) == [("call_1", "bash"), ("call_2", "bash"), ("call_3", "submit")]

    # the ids are the model server's, id for id, and NeMo RL's prefix check holds on every turn
    for mine, reply in zip(assistant, gym.replies):
        assert mine["input_ids"] == reply["prompt_token_ids"]
        assert mine["token_ids"] == reply["generation_token_ids"]
        assert mine["logprobs"] == reply["generation_log_probs"]
    assert nemo_rl_prefix_check(messages) == 3
    # ... because each later request handed the model server the previous turn's ids back
    for k, body in enumerate(gym.requests[1:], start=1):
        last = [m for m in body["messages"] if m["role"] == "assistant"][-1]
        assert last["prompt_token_ids"] == gym.replies[k - 1]["prompt_token_ids"]
        assert last["generation_token_ids"] == gym.replies[k - 1]["generation_token_ids"]
    assert result["token_mode"] == "exact"

    # the native result keeps its own shape
    assert result["job_id"].startswith(f"gym-{tmp_path.name}.")  # Gym's job_id labels a job of its own
    native = requests.get(f"{api}/jobs/{result['job_id']}", timeout=10).json()["result"]
    native_calls = [m for m in native["messages"] if m["role"] == "assistant"][0]["tool_calls"]
    assert native_calls[0]["function"]["name"] == "bash" and "input_ids" not in native["messages"][2]


def test_chat_client_reads_the_message_bundle_whole_or_refuses_it():
    """Gym's rule: the three token fields come together; a partial bundle or one that contradicts
    vLLM's own fields is a malformed completion (BackendFailed: retried on another backend)."""
    from prorl_celery.llm.clients.chat import ChatClient
    from prorl_celery.llm.models import LLMRequest, Protocol
    from prorl_celery.llm.routing import Slot

    slot = Slot.direct("b1", "http://gym", Protocol.CHAT, model="policy")
    request = LLMRequest(messages=[{"role": "user", "content": "hi"}])
    bundle = {"prompt_token_ids": [1, 4, 20], "generation_token_ids": [30, 2], "generation_log_probs": [-0.1, -0.2]}

    def completion(message_extra: dict, **top) -> dict:
        return {"choices": [{"message": {"role": "assistant", "content": "ok", **message_extra},
                             "finish_reason": "stop"}], **top}

    turn = ChatClient._turn(slot, request, "policy", completion(bundle))
    assert (turn.prompt_ids, turn.response_ids, turn.logprobs) == ([1, 4, 20], [30, 2], [-0.1, -0.2])
    assert turn.token_source == "server"
    for bad, why in ((completion({k: v for k, v in bundle.items() if k != "generation_log_probs"}), "partial"),
                     (completion(bundle, prompt_token_ids=[9, 9]), "disagree")):
        with pytest.raises(ValueError, match=why):  # generate() reports it as BackendFailed
            ChatClient._turn(slot, request, "policy", bad)


def test_only_the_nemo_gym_dialect_sends_the_token_history():
    """The ids of the previous turn go back on its assistant message for Gym's model server
    (``nemo-gym``); the ``vllm`` dialect sends only what vLLM reads."""
    from prorl_celery.llm.clients.chat import chat_body
    from prorl_celery.llm.dialects.chat_wire import GYM_FIELDS
    from prorl_celery.llm.models import LLMRequest, Protocol, Turn

    previous = Turn(backend_id="b", address="http://gym", weight_version=None, protocol=Protocol.CHAT, model="m",
                    content="ok", prompt_ids=[1, 4, 20], response_ids=[30, 2], logprobs=[-0.1, -0.2],
                    message_count=1)
    messages = [{"role": "user", "content": "hi"}, previous.message, {"role": "user", "content": "again"}]
    request = LLMRequest(messages=messages, previous=previous)
    bodies = {}
    for dialect in ("vllm", "nemo-gym"):
        from prorl_celery.llm.routing import Slot
        slot = Slot.direct("b", "http://gym", Protocol.CHAT, model="m", dialect=dialect)
        bodies[dialect] = chat_body(slot, request, "m")
        assert bodies[dialect]["return_token_ids"] is True
    assert not any(field in m for m in bodies["vllm"]["messages"] for field in GYM_FIELDS)
    assert bodies["vllm"]["messages"] == messages
    sent = bodies["nemo-gym"]["messages"][1]
    assert (sent["prompt_token_ids"], sent["generation_token_ids"], sent["generation_log_probs"]) == \
        ([1, 4, 20], [30, 2], [-0.1, -0.2])
    assert request.messages[1] == previous.message  # the request's own history is not changed
