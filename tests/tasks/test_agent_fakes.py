"""The agent loop's in-process fakes held to their real counterparts, side by side.

``ScriptedPolicy`` against the fake LLM server over real HTTP (loopback, the real ``generate``
client): the same script gives the same turns, id for id. ``DummySandbox`` against the real
``local`` runtime (a persistent bash in a temp directory): the same editor session gives the same
observations, and the same file errors."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from prorl_celery.fakes import ScriptedPolicy
from sandboxes.fake import DummySandbox
from prorl_celery.fakes.llm.server import make_server
from prorl_celery.llm.clients.generate import GenerateClient, build_prompt
from prorl_celery.llm.models import LLMRequest, Protocol, Turn
from prorl_celery.llm.routing import Slot
from prorl_celery.llm.tokenizer import get_tokenizer
from prorl_celery.llm.transport import Call
from sandboxes.base import SandboxSpec
from sandboxes.runtimes.local import LocalSandbox
from tasks.agent import AgentConfig, DefaultAgent, Timeouts
from tasks.agent.editor import Editor, EditorError

TASK = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix it."}]
SCRIPT = [{"content": "Looking.", "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]},
          "<tool_call>{not json</tool_call>",
          {"tool_calls": [{"name": "str_replace_editor",
                           "arguments": {"command": "create", "path": "/workspace/a.py", "file_text": "x = 1\n"}}]},
          {"tool_calls": [{"name": "submit", "arguments": {"answer": "done"}}]}]
TIMEOUTS = Timeouts(llm_call_s=30.0, action_s=5.0)
SAME = ("prompt_ids", "response_ids", "logprobs", "content", "finish_reason", "format_error", "protocol",
        "message_count", "token_source")


class HTTPPolicy:
    """The pool's part for one backend: the real generate client against a served fake."""

    def __init__(self, slot: Slot):
        self.slot = slot

    def generate(self, request: LLMRequest, should_stop) -> Turn:
        with Call(10, should_stop) as call:
            return GenerateClient().generate(self.slot, request, call)


@pytest.fixture
def served(tmp_path: Path):
    script = tmp_path / "turns.json"
    script.write_text(json.dumps(SCRIPT))
    servers = []

    def serve(max_model_len: int) -> tuple[HTTPPolicy, Path]:
        server, _ = make_server(policy=f"scripted:{script}", max_model_len=max_model_len)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        host, port = server.server_address[:2]
        slot = Slot.direct(backend_id="fake", address=f"http://{host}:{port}", protocol=Protocol.GENERATE,
                           model="prorl-fake-byte", tokenizer="byte", max_model_len=max_model_len, dialect="fake")
        return HTTPPolicy(slot), script

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def _episode(policy: Any) -> tuple[dict[str, Any], list[Turn]]:
    sandbox = DummySandbox().on(r"^ls$", "b.py\n")
    state: dict[str, Any] = {}
    loop = DefaultAgent(policy, sandbox, AgentConfig(), state=state, timeouts=TIMEOUTS)
    outcome = loop.run(TASK)
    assert outcome.finish_reason.value == state["finish_reason"]
    return state, loop.transcript.turns()


def _turn_fields(episode: tuple[dict[str, Any], list[Turn]]) -> list[dict[str, Any]]:
    turns = episode[1]
    return [{**{k: getattr(t, k) for k in SAME}, "calls": [(c.name, c.arguments) for c in t.tool_calls]}
            for t in turns]


@pytest.mark.parametrize("room", [None, 120])
def test_scripted_policy_gives_the_turns_the_served_fake_gives(served, room):
    """With room for the whole episode, and with a window that the third prompt overflows."""
    first = len(build_prompt(get_tokenizer("byte"), AgentConfig().request(list(TASK), None, 1.0)))
    max_model_len = 32768 if room is None else first + room
    http, script = served(max_model_len)
    over_http = _episode(http)
    in_process = _episode(ScriptedPolicy.from_file(script, max_model_len=max_model_len))
    assert over_http[0]["finish_reason"] == in_process[0]["finish_reason"] == (
        "submit" if room is None else "context")
    assert _turn_fields(in_process) == _turn_fields(over_http)
    assert len(over_http[1]) == (4 if room is None else 2)


# -- DummySandbox against the local runtime ----------------------------------------------------------
@pytest.fixture
def local():
    box = LocalSandbox(SandboxSpec(runtime="local"), "agent-fakes")
    yield box
    box.close()


EDITS = [{"command": "create", "path": "pkg/m.py", "file_text": "def f():\n    return 1\n"},
         {"command": "create", "path": "pkg/m.py", "file_text": "again"},
         {"command": "view", "path": "pkg/m.py"},
         {"command": "view", "path": "pkg/m.py", "view_range": [2, 2]},
         {"command": "view", "path": "pkg/m.py", "view_range": [3, 9]},
         {"command": "str_replace", "path": "pkg/m.py", "old_str": "return 1", "new_str": "return 2"},
         {"command": "str_replace", "path": "pkg/m.py", "old_str": "nowhere", "new_str": ""},
         {"command": "insert", "path": "pkg/m.py", "insert_line": 0, "new_str": "import os"},
         {"command": "undo_edit", "path": "pkg/m.py"},
         {"command": "undo_edit", "path": "pkg/m.py"},
         {"command": "undo_edit", "path": "pkg/m.py"},
         {"command": "view", "path": "missing.py"},
         {"command": "create", "path": "/etc/passwd-agent", "file_text": "no"},
         {"command": "remove", "path": "pkg/m.py"}]


def _session(sandbox: Any) -> list[str]:
    editor, out = Editor(sandbox, {}), []
    for args in EDITS:
        try:
            out.append(editor(args))
        except EditorError as exc:
            out.append(f"Error: {str(exc).split(': [Errno')[0]}")
    return out


def test_the_editor_reads_the_same_on_the_dummy_and_the_local_runtime(local):
    dummy = DummySandbox(workspace=local.workspace.mount)
    dummy.cwd = local.exec("pwd").output.strip()
    real, fake = _session(local), _session(dummy)
    assert fake == real
    assert any("return 2" in line for line in real) and real[-3].endswith("does not exist")
    assert dummy.files == {"pkg/m.py": local.read_file("pkg/m.py")}


def test_file_errors_are_those_of_the_local_runtime(local):
    dummy = DummySandbox({"d/f.txt": "x"}, workspace=local.workspace.mount)
    local.write_file("d/f.txt", b"x")
    for op in (lambda s: s.read_file("nope.txt"), lambda s: s.read_file("d"), lambda s: s.write_file("d", b"y"),
               lambda s: s.read_file("../escape"), lambda s: s.write_file("/etc/x", b"y"),
               lambda s: s.read_file(local.workspace.mount)):
        with pytest.raises(OSError) as real:
            op(local)
        with pytest.raises(OSError) as fake:
            op(dummy)
        assert (type(fake.value), fake.value.errno) == (type(real.value), real.value.errno)
    for command in ("test -d d", "test -e d/f.txt", "test -f d", "test -e nope", "stat -L -c %s -- d/f.txt",
                    "stat -L -c %s -- nope 2>/dev/null", "cd d", "pwd", "cd nope"):
        a, b = local.exec(command), dummy.exec(command)
        assert (b.exit_code, b.output if "nope" not in command else "") == \
               (a.exit_code, a.output if "nope" not in command else ""), command
