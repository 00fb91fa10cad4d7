"""Rollouts through the whole service against a real llama.cpp server (SmolLM2-135M): token mode
(dialect llama.cpp, /completion with token ids) and chat mode with tools; registration refuses a
server that lacks what was asked, naming the flag."""
from __future__ import annotations

import http.server
import json
import math
import threading

import pytest
import requests

from prorl_celery.llm import chatml
from tests.conftest import submit, wait

MATH = {"data_source": "math", "problem": "What is 2 + 3?", "answer": "5"}
TERMINAL = {"completed", "failed", "cancelled"}


def _register(api: str, **body) -> dict:
    requests.post(f"{api}/clear_llm_server", timeout=10)
    resp = requests.post(f"{api}/llm_servers", json=body, timeout=120)
    assert resp.status_code == 201, resp.text
    return resp.json()["backend"]


def test_registration_refuses_tools_without_jinja(api, llamacpp_no_jinja):
    resp = requests.post(f"{api}/llm_servers", json={"address": llamacpp_no_jinja, "dialect": "llama.cpp",
                                                     "tools": True}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["field"] == "tools" and "--jinja" in error["message"]
    listed = requests.get(f"{api}/llm_servers", timeout=10).json()["backends"]
    assert all(b["address"] != llamacpp_no_jinja for b in listed)  # not registered


def test_token_mode_rollouts_are_exact_and_rescore(api, llamacpp, smol_tokenizer):
    backend = _register(api, address=llamacpp, protocol="generate", dialect="llama.cpp", tokenizer=smol_tokenizer,
                        exact_tokens=True)
    assert backend["max_model_len"] == 2048  # read from /v1/models (meta.n_ctx of a slot)
    jobs = [submit(api, {**MATH, "problem": f"What is {i} + 3?", "answer": str(i + 3)},
                   sampling_params={"token_level_generation": True, "max_turns": 3, "max_tokens": 24, "seed": i})
            for i in range(1)]
    views = [wait(api, job, timeout=240) for job in jobs]
    for view in views:
        assert view["status"] in TERMINAL and isinstance(view["result"], dict), view
        assert view["status"] == "completed", view["result"]
        tokens = view["result"]["tokens"]
        assert len(tokens["logprobs"]) == len(tokens["response_ids"]) == len(tokens["loss_mask"])
    tokens = views[0]["result"]["tokens"]
    # the client's tokenizer gives the server's own ids for the first prompt
    text = requests.post(f"{llamacpp}/detokenize", json={"tokens": tokens["prompt_ids"]}, timeout=10).json()["content"]
    server_ids = requests.post(f"{llamacpp}/tokenize", json={"content": text, "parse_special": True},
                               timeout=10).json()["tokens"]
    assert server_ids == tokens["prompt_ids"]
    # re-score the first generated tokens: the server's logprob of each recorded id, given the ids before it
    ids, mask, lps = tokens["response_ids"], tokens["loss_mask"], tokens["logprobs"]
    first = next(i for i, m in enumerate(mask) if m == 1)
    context = tokens["prompt_ids"] + ids[:first]
    for k in range(first, min(first + 6, len(ids))):
        if mask[k] != 1:
            break
        out = requests.post(f"{llamacpp}/completion", json={
            "prompt": context, "n_predict": 1, "n_probs": 400, "post_sampling_probs": False, "temperature": 1.0,
            "top_k": 0, "top_p": 1.0, "min_p": 0.0, "samplers": ["temperature"], "cache_prompt": True}, timeout=60).json()
        top = {p["id"]: p["logprob"] for p in out["completion_probabilities"][0]["top_logprobs"]}
        assert ids[k] in top, f"token {ids[k]} not in the server's top 400 at {k}"
        # measured: up to ~0.02 nats apart (Q4_1 on CPU; the rollout's step was batched with other
        # slots and its prompt evaluated through the prompt cache, the re-score alone)
        assert math.isclose(top[ids[k]], lps[k], abs_tol=5e-2), (k, top[ids[k]], lps[k])
        context = context + [ids[k]]


def test_chat_mode_with_tools(api, llamacpp):
    _register(api, address=llamacpp, protocol="chat", dialect="llama.cpp", tools=True)
    jobs = [submit(api, MATH, sampling_params={"token_level_generation": False, "max_turns": 2, "max_tokens": 40,
                                               "tool_choice": "required", "seed": i}) for i in range(1)]
    for job in jobs:
        view = wait(api, job, timeout=240)
        assert view["status"] in TERMINAL and isinstance(view["result"], dict), view
        for message in view["result"]["messages"]:
            if message["role"] == "assistant" and message.get("logprobs") is not None:
                assert len(message["logprobs"]) == len(message.get("response_ids") or message["logprobs"])


# -- a domain with a sandbox (code), the ids seen on the wire --------------------------------------
# (the ``shell`` domain runs its commands without a model, so the LLM domain with a sandbox and the
# bash tool is ``code``; its sandbox runs on the local runtime here, which the test stack allows)

CODE = {"data_source": "code", "sandbox": {"runtime": "local"},
        "prompt": "Write a Python function add(a, b) that returns a + b. Explain every step in detail first.",
        "tests": "assert add(2, 3) == 5"}


class _Recorder(http.server.ThreadingHTTPServer):
    """A logging proxy in front of llama.cpp: the request and answer bodies of every POST, as
    they went over the wire (what the service sent, what the server returned)."""

    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream = upstream
        self.calls: list[tuple[str, dict, dict]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def posts(self, path: str) -> list[tuple[dict, dict]]:
        with self.lock:
            return [(sent, got) for p, sent, got in self.calls if p == path]


def _answer(up: requests.Response) -> dict:
    """The answer as one document: a streamed one's events joined (tokens and their
    probabilities in order, the rest from the last event)."""
    if "text/event-stream" not in up.headers.get("Content-Type", ""):
        return up.json()
    events = [json.loads(line[5:]) for line in up.text.splitlines() if line.startswith("data:")]
    whole = dict(events[-1])
    whole["tokens"] = [t for e in events for t in e.get("tokens") or []]
    if any("completion_probabilities" in e for e in events):
        whole["completion_probabilities"] = [p for e in events for p in e.get("completion_probabilities") or []]
    return whole


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass

    def _relay(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
        up = requests.request(method, self.server.upstream + self.path, data=raw or None, headers=headers,
                              timeout=300)
        if method == "POST":
            try:
                record = (self.path, json.loads(raw or b"{}"), _answer(up))
            except ValueError:
                record = (self.path, {}, {})
            with self.server.lock:
                self.server.calls.append(record)
        self.send_response(up.status_code)
        self.send_header("Content-Type", up.headers.get("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(up.content)))
        self.end_headers()
        self.wfile.write(up.content)

    def do_GET(self) -> None:
        self._relay("GET")

    def do_POST(self) -> None:
        self._relay("POST")


@pytest.fixture
def recorder(llamacpp):
    server = _Recorder(llamacpp)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _detokenize(llamacpp: str, ids: list[int]) -> str:
    resp = requests.post(f"{llamacpp}/detokenize", json={"tokens": ids}, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()["content"]


def test_token_mode_code_domain_prompts_grow_by_exactly_the_new_messages(api, llamacpp, recorder, smol_tokenizer):
    _register(api, address=recorder.url, protocol="generate", dialect="llama.cpp", tokenizer=smol_tokenizer,
              exact_tokens=True)
    before = len(recorder.posts("/completion"))  # the registration probe's
    # 8 tokens cut every reply off (format_error "length"): the agent answers with a user message
    # and the episode goes on to max_turns
    view = wait(api, submit(api, CODE, sampling_params={"token_level_generation": True, "max_turns": 3,
                                                        "max_tokens": 8, "seed": 7}), timeout=120)
    assert view["status"] == "completed" and isinstance(view["result"], dict), view
    result = view["result"]
    assert result["token_mode"] == "exact", result
    wire = recorder.posts("/completion")[before:]
    assert len(wire) == result["turns"] >= 2, (len(wire), result["turns"], result.get("finish_reason"))
    sent = [body["prompt"] for body, _ in wire]
    got = [[int(i) for i in answer["tokens"]] for _, answer in wire]
    assert all(isinstance(p, list) and all(isinstance(i, int) for i in p) for p in sent)  # token ids, not text
    # the messages the agent added between turns, in order: what followed each assistant message
    messages = result["messages"]
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(at) == len(wire)
    for k, i in enumerate(at):
        assert messages[i]["token_ids"] == got[k]  # the result records the server's own ids
        assert len(messages[i]["logprobs"]) == len(got[k])
    for k in range(1, len(wire)):
        previous = sent[k - 1] + got[k - 1]
        assert sent[k][: len(previous)] == previous, f"turn {k}: the prompt is not the previous ids + response"
        added = _detokenize(llamacpp, sent[k][len(previous):])
        new = [m for m in messages[at[k - 1] + 1: at[k]] if m["role"] in ("user", "tool")]
        assert new, f"turn {k}: no message between the turns"
        for message in new:
            assert message["content"] in added, (k, message["content"], added)
        # nothing but the new messages (and the template's markers around them) was added
        assert added.endswith("<|im_start|>assistant\n"), added
    # the flattened trajectory is exactly what went over the wire
    tokens = result["tokens"]
    assert tokens["prompt_ids"] == sent[0]
    assert tokens["prompt_ids"] + tokens["response_ids"] == sent[-1] + got[-1]
    assert len(tokens["logprobs"]) == len(tokens["response_ids"]) == len(tokens["loss_mask"])
    assert sum(tokens["loss_mask"]) == sum(len(g) for g in got)


def test_chat_mode_code_domain_with_required_tools(api, llamacpp, recorder):
    """tool_choice required reaches llama.cpp as its own grammar (one Hermes call, tool_choice none:
    the server refuses a grammar beside parsed tools), so every turn is a real tool call the server
    wrote, read from its answer's text and answered from the sandbox."""
    _register(api, address=recorder.url, protocol="chat", dialect="llama.cpp", tools=True)
    before = len(recorder.posts("/v1/chat/completions"))
    jobs = [submit(api, CODE, sampling_params={"token_level_generation": False, "max_turns": 3, "max_tokens": 96,
                                               "tool_choice": "required", "seed": i}) for i in range(2)]
    views = [wait(api, job, timeout=600) for job in jobs]
    for view in views:
        assert view["status"] in TERMINAL and isinstance(view["result"], dict), view
        assert view["status"] == "completed", view["result"]
    wire = recorder.posts("/v1/chat/completions")[before:]
    assert wire and all(body.get("tool_choice") == "none" and "root ::=" in body.get("grammar", "") and body.get("tools")
                        for body, _ in wire)
    # the calls as the server wrote them (its text, in the Hermes block the grammar admits)
    written = [chatml.split_tool_calls(answer["choices"][0]["message"]["content"] or "") for _, answer in wire]
    complete = [calls for _, calls, malformed in written if calls and not malformed]
    assert complete, [answer["choices"][0] for _, answer in wire]
    # the ids llama.cpp itself returned, per call (each logprob entry names its token)
    served = sorted([int(e["id"]) for e in answer["choices"][0]["logprobs"]["content"]] for _, answer in wire)
    assistants = [m for v in views for m in v["result"]["messages"] if m["role"] == "assistant"]
    assert len(assistants) == len(wire) >= 2
    for message in assistants:
        assert message.get("token_ids") and len(message["logprobs"]) == len(message["token_ids"]), message
    assert sorted(m["token_ids"] for m in assistants) == served  # the result's ids are the server's, none lost
    # every turn that the model finished within max_tokens is a tool call, the one the server wrote
    parsed = sorted((c["function"]["name"], c["function"]["arguments"]) for m in assistants for c in m.get("tool_calls") or [])
    assert parsed == sorted((c.name, c.arguments) for calls in complete for c in calls)
    assert len([m for m in assistants if m.get("tool_calls")]) == len(complete)
    tool_names = {"bash", "str_replace_editor", "submit"}
    assert {name for name, _ in parsed} <= tool_names
    for view in views:
        messages = view["result"]["messages"]
        for i, message in enumerate(messages):
            if message["role"] == "assistant" and message.get("tool_calls"):
                calls = [c for c in message["tool_calls"] if c["function"]["name"] != "submit"]
                answers = [m for m in messages[i + 1:i + 1 + len(calls)] if m["role"] == "tool"]
                assert len(answers) == len(calls), messages[i:]
