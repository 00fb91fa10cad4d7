"""check_dialect: every built-in dialect conforms, statically and against the exchanges recorded
from its real server (tests/fixtures/recorded); a dialect that could not serve is refused naming
what is wrong; an unknown name lists the known ones; an operator's dialect is one file away."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from prorl_celery.errors import LLMRequestRejected, UnknownPlugin
from prorl_celery.llm import dialects
from prorl_celery.llm.dialects import DIALECTS
from prorl_celery.llm.dialects.base import Dialect, Generated, TokenWire
from prorl_celery.llm.dialects.check import check_dialect, check_recorded
from prorl_celery.llm.dialects.llamacpp import LlamaCpp, LlamaCppChat
from prorl_celery.llm.dialects.sampling import Sampling
from prorl_celery.llm.dialects.vllm import VllmCompletions, VllmCompletionsWire
from prorl_celery.llm.models import BackendSpec, Backend, BackendStatus, LLMRequest, PauseApi, Protocol
from prorl_celery.llm.pause import effective_mode

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

RECORDED = Path(__file__).resolve().parent.parent / "fixtures" / "recorded"
LLM = Path(__file__).resolve().parents[2] / "prorl_celery" / "llm"


def records() -> list[dict[str, Any]]:
    out = []
    for path in sorted(RECORDED.glob("*/*.json")):
        record = json.loads(path.read_text())
        out.append({**record, "name": f"{path.parent.name}/{path.stem}"})
    return out


@pytest.mark.parametrize("name", sorted(DIALECTS.entries))
def test_builtin_dialects_conform(name):
    cls = DIALECTS.load(name)  # the registry runs check_dialect on load
    check_dialect(cls)
    assert cls.name == name and cls.protocols()


@pytest.mark.parametrize("name", sorted(DIALECTS.entries))
def test_builtin_dialects_read_what_their_server_was_recorded_answering(name):
    assert check_recorded(dialects.get(name), records()) == []


def test_the_recordings_cover_every_wire_of_the_recorded_servers():
    """The check above is not empty: each wire of a dialect of vLLM or llama.cpp has recorded
    answers on its path."""
    answered = {(r["server"].split(" ")[0], r["request"]["path"]) for r in records() if r["status"] == 200}
    for name in sorted(DIALECTS.entries):
        cls = dialects.get(name)
        if cls.server in ("vllm", "llama.cpp"):
            for wire in filter(None, (cls.chat, cls.token)):
                assert (cls.server, wire.path) in answered, (name, wire.path)


class WrongPenaltyName(LlamaCppChat):
    sampling = Sampling(names={}, top_k_off=0)  # llama.cpp reads repeat_penalty


class WrongPenalty(LlamaCpp):
    chat = WrongPenaltyName()


class DropsALogprob(VllmCompletionsWire):
    def answer(self, data):
        out = super().answer(data)
        return out._replace(logprobs=(out.logprobs or [0.0, 0.0])[1:])


class ReadsTheWrongField(VllmCompletionsWire):
    def answer(self, data):
        return Generated(data["choices"][0]["output_ids"], None, "stop")


@pytest.mark.parametrize("token, chat, finding", [
    (None, WrongPenaltyName(), "sends repetition_penalty, never seen taken by llama.cpp"),
    (DropsALogprob(), None, "logprobs for"),
    (ReadsTheWrongField(), None, "reading raised KeyError"),
])
def test_recorded_check_catches_a_dialect_that_drifts_from_its_server(token, chat, finding):
    base = WrongPenalty if chat is not None else VllmCompletions
    cls = type("Drifted", (base,), {"token": token or base.token, "chat": chat or base.chat})
    found = check_recorded(cls, records())
    assert any(finding in f for f in found), found


class Nameless(Dialect):
    token = VllmCompletionsWire()


class NoWire(Dialect):
    name = "no-wire"


class BadWire(Dialect):
    name = "bad-wire"
    token = object()


class BodyTakesTwo(TokenWire):
    path = "/x"

    def body(self, request, model):
        return {}


class BadHooks(Dialect):
    name = "bad-hooks"
    token = BodyTakesTwo()
    pause_apis = frozenset({"vllm"})
    probe_hints = {"tool": "--jinja"}


class StreamedWithoutEvents(TokenWire):
    path = "/x"
    streamed = True


class BadStream(Dialect):
    name = "bad-stream"
    token = StreamedWithoutEvents()


@pytest.mark.parametrize("cls, finding", [
    (Nameless, "no name"),
    (NoWire, "no wire: neither chat nor token"),
    (BadWire, "token is not a TokenWire"),
    (BadHooks, "token: body(request, model, tok, prompt, max_tokens) cannot be called"),
    (BadHooks, "pause_apis holds something other than vllm or sglang"),
    (BadHooks, "probe_hints must map some of tools, dialect, exact_tokens to str"),
    (BadStream, "streamed, but read_events is not implemented"),
])
def test_nonconforming_dialects_are_refused_naming_the_problem(cls, finding):
    with pytest.raises(UnknownPlugin) as info:
        check_dialect(cls)
    assert finding in str(info.value) and cls.__qualname__ in str(info.value)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(UnknownPlugin, match="unknown LLM dialect 'sglang2'; known: fake, llama.cpp, nemo-gym"):
        dialects.get("sglang2")
    with pytest.raises(ValueError, match="dialect\n  Value error, unknown LLM dialect 'sglang2'; known: fake"):
        BackendSpec(address="http://x", dialect="sglang2")
    with pytest.raises(LLMRequestRejected, match="dialect sglang2 is not available here"):
        dialects.token_wire("sglang2")
    assert dialects.token_of("sglang2") is None


def test_the_protocol_a_dialect_speaks_is_what_registration_takes():
    assert BackendSpec(address="http://x", protocol="generate", dialect="llama.cpp").dialect == "llama.cpp"
    assert BackendSpec(address="http://x", dialect="llama.cpp").protocol is Protocol.CHAT
    with pytest.raises(ValueError, match="one of fake, llama.cpp, sglang, vllm-completions, vllm-generate"):
        BackendSpec(address="http://x", protocol="generate", dialect="openai")
    # pydantic's templates take {name} only: '{name!r}' came out as written
    with pytest.raises(ValueError, match=r"'vllm-generate' is a wire format of the generate protocol: set protocol "
                                         r"to generate \(chat takes llama.cpp, nemo-gym, openai, sglang, vllm\)"):
        BackendSpec(address="http://x", dialect="vllm-generate")


class Echo(Dialect):
    """An operator's dialect: one class in one file, named by its dotted path."""

    name = "echo"
    server = "echo"
    token = type("EchoWire", (VllmCompletionsWire,), {"streamed": True, "read_events": lambda self, e, i, lp: None})()


def test_an_operators_dialect_is_a_dotted_path_away(monkeypatch):
    from config.settings import get_settings

    path = f"{__name__}:Echo"
    monkeypatch.setenv("PRORL_PLUGIN_PACKAGES", "")
    get_settings.cache_clear()
    try:
        with pytest.raises(ValueError, match="in none of the allowed packages"):
            BackendSpec(address="http://x", protocol="generate", dialect=path)
        monkeypatch.setenv("PRORL_PLUGIN_PACKAGES", "tests")  # as tests/conftest.py sets it
        get_settings.cache_clear()
        spec = BackendSpec(address="http://x", protocol="generate", dialect=path)
        assert spec.dialect == path and dialects.token_wire(path) is Echo.token
        backend = Backend(id="b", address="http://x", protocol=Protocol.GENERATE, dialect=path, capacity=1,
                          status=BackendStatus.ACTIVE)
        assert effective_mode(backend, "keep") == "abort"  # its streamed wire: the service can cut a turn
    finally:
        get_settings.cache_clear()
        dialects._loaded.pop(path, None)


def test_declarations_decide_the_pause_mode():
    def mode(dialect: str, api: PauseApi | None, asked: str = "keep") -> str:
        backend = Backend(id="b", address="http://x", protocol=Protocol.GENERATE, dialect=dialect, capacity=1,
                          status=BackendStatus.ACTIVE, pause_api=api)
        return effective_mode(backend, asked)

    assert [mode(d, PauseApi.VLLM) for d in ("fake", "vllm-generate", "vllm-completions")] == ["keep", "keep", "abort"]
    assert [mode(d, None) for d in ("llama.cpp", "sglang", "fake")] == ["abort", "drain", "drain"]


def test_no_dialect_enum_or_table_outside_the_room():
    """What one server is lives in its dialect module: no ``Dialect.X`` branch elsewhere in llm/."""
    found = [f"{path.relative_to(LLM)}:{n}" for path in LLM.rglob("*.py") if "dialects" not in path.parts
             for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"Dialect\.[A-Z]", line)]
    assert found == []


def test_the_chat_default_and_the_bodies_each_dialect_builds():
    request = LLMRequest(messages=[{"role": "user", "content": "hi"}])
    assert dialects.chat_wire(None) is dialects.get("vllm").chat
    assert dialects.chat_wire(None).body(request, "m")["return_token_ids"] is True
    assert "top_k" not in dialects.chat_wire("openai").body(request, "m")
    assert dialects.chat_wire("llama.cpp").body(request, "m")["top_k"] == 0
    with pytest.raises(LLMRequestRejected, match="dialect fake does not speak the chat protocol"):
        dialects.chat_wire("fake")
    with pytest.raises(LLMRequestRejected, match="has no dialect"):
        dialects.token_wire(None, "b1")
