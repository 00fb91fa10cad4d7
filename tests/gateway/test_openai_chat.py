"""The session gateway over real HTTP with the real ``openai`` client, generating through the LLM
pool (real Redis) against the fake LLM in token mode: what the caller gets back, what is recorded
on the rollout store (the very ids the server generated, each prompt stored as the ids past the
last call's), how calls chain, and each failure in OpenAI's shape."""
from __future__ import annotations

import importlib.util
import json
import secrets

import pytest
import requests

from prorl_celery.gateway import Budget, CallLog, Gateway, GatewaySession
from prorl_celery.rollout.segments import continued, harness_fields, merged, prompts
from prorl_celery.rollout.store import RolloutStore
from tests.llm.conftest import TOOLS, add

if importlib.util.find_spec("openai") is None:
    pytest.skip("the 'openai' package is not installed", allow_module_level=True)
SYSTEM = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List the files."}]


def _gateway(pool, redis_conn, budget=None, **session) -> Gateway:
    sid = f"gw-{secrets.token_hex(4)}"
    sess = GatewaySession(sid, lambda req, stop: pool.generate(sid, req, should_stop=stop),
                          CallLog.to_store(RolloutStore(redis_conn), sid), budget=budget, **session)
    return Gateway(sess, token=secrets.token_urlsafe(16)).start()


def _sdk():
    """The ``openai`` package, imported when a test runs (seconds: not at every collection)."""
    import openai

    return openai


def stored(gw: Gateway, redis_conn):
    """The session's calls and conversation as the rollout store holds them (its log closed)."""
    gw.session.log.close()
    store = RolloutStore(redis_conn)
    return store.read(gw.session.session_id), store.messages(gw.session.session_id)


def _client(gw: Gateway):
    return _sdk().OpenAI(base_url=gw.url + "/v1", api_key=gw.token, max_retries=0)


def _harness_loop(client, stream: bool = False) -> list:
    """What a harness does: call, run the tool, append the answer and the result, call again."""
    messages, answers = list(SYSTEM), []
    for k in range(3):
        if stream:
            parts = list(client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True))
            message = _assemble(parts)
        else:
            message = client.chat.completions.create(model="m", messages=messages, tools=TOOLS) \
                .choices[0].message.model_dump(exclude_none=True)
        answers.append(message)
        messages.append(message)
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"result {k}"})
    return answers


def _assemble(chunks) -> dict:
    content, calls = "", {}
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                calls[call.index] = {"id": call.id, "type": "function",
                                     "function": {"name": call.function.name, "arguments": call.function.arguments}}
    out = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_calls_are_recorded_with_the_servers_own_ids_and_chain(fake_llms, pool, redis_conn, script, stream):
    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    add(pool, proc, protocol="generate", weight_version="v7")
    with _gateway(pool, redis_conn) as gw:
        answers = _harness_loop(_client(gw), stream=stream)
    records, conversation = stored(gw, redis_conn)
    assert [a["tool_calls"][0]["function"]["name"] for a in answers[:2]] == ["bash", "bash"]
    assert json.loads(answers[1]["tool_calls"][0]["function"]["arguments"]) == {"cmd": "cat a.txt"}
    assert answers[2]["content"] == "Done: the answer is 42." and not answers[2].get("tool_calls")
    served = [r for r in proc.received() if r["status"] == "ok"]
    assert len(records) == len(served) == 3
    assert [r.response_ids for r in records] == [s["response_ids"] for s in served]
    assert prompts(records) == [s["prompt_ids"] for s in served]
    assert [continued(r) for r in records] == [False, True, True]
    assert all(r.meta["weight_version"] == "v7" and len(r.logprobs) == len(r.response_ids) for r in records)
    assert [r.meta["gateway"]["api"] for r in records] == ["openai_chat"] * 3
    # stored linearly: a later call keeps only the ids past the last call's prompt + response
    assert records[2].keep == len(served[1]["prompt_ids"]) + len(served[1]["response_ids"])
    assert len(records[2].new_ids) < 40
    # the conversation once: what each call added, its answers the ones generated
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                 "assistant"]
    assert [m["content"] or None for m in conversation if m["role"] == "assistant"] == \
        [a.get("content") or None for a in answers]
    (segment,) = merged(records)
    assert segment["prompt_ids"] == served[0]["prompt_ids"]
    assert segment["prompt_ids"] + segment["response_ids"] == served[2]["prompt_ids"] + served[2]["response_ids"]
    assert sum(segment["loss_mask"]) == sum(len(s["response_ids"]) for s in served)
    view = harness_fields(records)
    assert view["token_mode"] == "exact" and view["counts"]["masked_tokens"] == segment["loss_mask"].count(0) > 0


def test_a_rewritten_history_starts_a_new_segment(fake_llms, pool, redis_conn, script):
    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    add(pool, proc, protocol="generate")
    with _gateway(pool, redis_conn) as gw:
        client = _client(gw)
        first = client.chat.completions.create(model="m", messages=SYSTEM, tools=TOOLS).choices[0].message
        edited = {"role": "assistant", "content": "something the model never said"}
        client.chat.completions.create(model="m", messages=[*SYSTEM, edited, {"role": "user", "content": "go on"}],
                                       tools=TOOLS)
    records, conversation = stored(gw, redis_conn)
    assert first.tool_calls and [continued(r) for r in records] == [False, False]
    segments = merged(records)
    assert [s["reason"] for s in segments] == ["first", "not_a_prefix"]
    assert harness_fields(records)["token_mode"] == "segmented"
    # the second call's history is stored whole again, the edited answer marked as no call's
    assert [m.get("resent", False) for m in conversation if m["role"] == "assistant"] == [False, True, False]


def test_models_and_failures_in_openai_shapes(fake_llms, pool, redis_conn, script):
    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    add(pool, proc, protocol="generate", max_model_len=600)
    with _gateway(pool, redis_conn, budget=Budget(max_calls=1)) as gw:
        url, auth = gw.url + "/v1", {"Authorization": f"Bearer {gw.token}"}
        assert requests.get(f"{url}/models", headers=auth, timeout=5).json()["data"][0]["id"] == "prorl-gateway"
        wrong = requests.post(f"{url}/chat/completions", json={"messages": SYSTEM}, timeout=5,
                              headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        bad = requests.post(f"{url}/chat/completions", json={"messages": []}, headers=auth, timeout=5)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        notjson = requests.post(f"{url}/chat/completions", data=b"{", headers=auth, timeout=5)
        assert notjson.status_code == 400 and notjson.json()["error"]["type"] == "invalid_request_error"
        long = [{"role": "user", "content": "x" * 2000}]
        over = requests.post(f"{url}/chat/completions", json={"messages": long}, headers=auth, timeout=10)
        assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
        with pytest.raises(_sdk().BadRequestError):
            _client(gw).chat.completions.create(model="m", messages=long)
        ok = requests.post(f"{url}/chat/completions", json={"messages": SYSTEM, "tools": TOOLS}, headers=auth,
                           timeout=10)
        assert ok.status_code == 200, ok.text
        spent = requests.post(f"{url}/chat/completions", json={"messages": SYSTEM}, headers=auth, timeout=10)
        assert spent.status_code == 403 and spent.json()["error"]["type"] == "insufficient_quota"
        assert gw.session.finish_reason == "max_calls" and len(gw.session.calls()) == 1


def test_cancel_aborts_the_call_in_flight(fake_llms, pool, redis_conn, script):
    import threading
    import time

    (proc,) = fake_llms(1, policy=f"scripted:{script}", latency="step_s=0.5,capacity=4")
    add(pool, proc, protocol="generate")
    with _gateway(pool, redis_conn) as gw:
        out = {}

        def call():
            out["resp"] = requests.post(gw.url + "/v1/chat/completions", json={"messages": SYSTEM}, timeout=30,
                                        headers={"Authorization": f"Bearer {gw.token}"})

        thread = threading.Thread(target=call)
        thread.start()
        deadline = time.monotonic() + 10
        while gw.session.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        gw.session.cancel()
        thread.join(10)
        assert not thread.is_alive()
    assert out["resp"].status_code == 503 and out["resp"].json()["error"]["code"] == "cancelled"
    assert stored(gw, redis_conn) == ([], [])


def _exchange(sock, request: bytes) -> tuple[bytes, bytes]:
    """Send ``request``; read one answer (past an interim ``100 Continue``): head, body by its length."""
    sock.sendall(request)
    data = b""
    while True:
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, data = data.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 100"):
            break
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(data) < length:
        data += sock.recv(65536)
    return head, data


def test_raw_http_keep_alive_streams_expect_and_bad_headers(fake_llms, pool, redis_conn, script):
    """The gateway's own request parsing over a raw socket: a streamed answer has its length and
    the connection serves the next call; ``Expect: 100-continue`` is answered; HTTP/1.0 is served;
    a malformed header line gets a 400 and the connection closes."""
    import socket

    (proc,) = fake_llms(1, policy=f"scripted:{script}")
    add(pool, proc, protocol="generate")
    with _gateway(pool, redis_conn) as gw:
        host, port = gw.address[:2]

        def call(stream: bool, expect: bool = False) -> bytes:
            body = json.dumps({"messages": SYSTEM, "tools": TOOLS, "stream": stream}).encode()
            extra = b"Expect: 100-continue\r\n" if expect else b""
            return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + gw.token.encode()
                    + b"\r\nContent-Type: application/json\r\n" + extra
                    + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)

        with socket.create_connection((host, port), timeout=20) as sock:
            head, body = _exchange(sock, call(stream=True))
            assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
            assert body.rstrip().endswith(b"data: [DONE]") and b'"tool_calls"' in body
            head, body = _exchange(sock, call(stream=False, expect=True))  # the same connection
            assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["object"] == "chat.completion"
        with socket.create_connection((host, port), timeout=20) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.0\r\nAuthorization: Bearer " + gw.token.encode() + b"\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.") and b"prorl-gateway" in data
        with socket.create_connection((host, port), timeout=20) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nno colon here\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 400")  # and the server closed the connection
