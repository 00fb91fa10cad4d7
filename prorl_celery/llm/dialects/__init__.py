"""LLM server dialects by name: the name a backend registers with (``BackendSpec.dialect``) ->
the dotted path of its :class:`~prorl_celery.llm.dialects.base.Dialect`, imported on first use and
checked by :func:`~prorl_celery.llm.dialects.check.check_dialect`. An operator's own dialect is a
dotted path away (in a package of ``PRORL_PLUGIN_PACKAGES``); an unknown name lists the known ones.
"""
from __future__ import annotations

from prorl_celery.errors import LLMRequestRejected, UnknownPlugin
from prorl_celery.llm.dialects.base import Dialect, TokenWire
from prorl_celery.llm.dialects.chat_wire import ChatWire
from prorl_celery.llm.dialects.check import check_dialect
from prorl_celery.llm.models import Protocol
from prorl_celery.plugins import Registry

DIALECTS = Registry("LLM dialect", {
    "openai": "prorl_celery.llm.dialects.openai:OpenAI",
    "vllm": "prorl_celery.llm.dialects.vllm:Vllm",
    "vllm-completions": "prorl_celery.llm.dialects.vllm:VllmCompletions",
    "vllm-generate": "prorl_celery.llm.dialects.vllm:VllmGenerate",
    "sglang": "prorl_celery.llm.dialects.sglang:SGLang",
    "llama.cpp": "prorl_celery.llm.dialects.llamacpp:LlamaCpp",
    "nemo-gym": "prorl_celery.llm.dialects.nemo_gym:NemoGym",
    "fake": "prorl_celery.llm.dialects.fake:Fake",
}, check=check_dialect, required=("name", "chat", "token"))
DEFAULT_CHAT = "vllm"  # a chat backend registered without a dialect

_loaded: dict[str, type[Dialect]] = {}  # by the name it was asked for: one lookup per call


def get(name: str) -> type[Dialect]:
    """The dialect ``name`` stands for, checked; :class:`UnknownPlugin` lists the known ones."""
    found = _loaded.get(name)
    if found is None:
        found = _loaded[name] = DIALECTS.load(name)
    return found


def serving(protocol: Protocol) -> list[str]:
    """The built-in dialects that speak ``protocol``, sorted (each one's module is imported)."""
    return sorted(name for name in DIALECTS.entries if protocol in get(name).protocols())


def token_of(name: str | None) -> TokenWire | None:
    """The token wire dialect ``name`` declares; None where there is no dialect, no token API, or
    none that loads here (what the service may do with a backend is decided from it)."""
    try:
        return get(name).token if name else None
    except UnknownPlugin:
        return None


def _available(name: str) -> type[Dialect]:
    try:
        return get(name)
    except UnknownPlugin as exc:
        raise LLMRequestRejected(f"dialect {name} is not available here: {exc}") from None


def chat_wire(name: str | None) -> ChatWire:
    """The chat wire of dialect ``name`` (None: :data:`DEFAULT_CHAT`); LLMRequestRejected when it
    has none or cannot be loaded here."""
    wire = _available(name or DEFAULT_CHAT).chat
    if wire is None:
        raise LLMRequestRejected(f"dialect {name} does not speak the chat protocol")
    return wire


def token_wire(name: str | None, backend_id: str = "") -> TokenWire:
    """The token wire of dialect ``name``; LLMRequestRejected when there is no dialect (a token
    API has no default: real servers share none), it has no token API, or it cannot be loaded."""
    if name is None:
        raise LLMRequestRejected(f"backend {backend_id} has no dialect: register it with the server's "
                                 "token API (llama.cpp, sglang, vllm-completions, vllm-generate)")
    wire = _available(name).token
    if wire is None:
        raise LLMRequestRejected(f"dialect {name} is not a token API")
    return wire


__all__ = ["DEFAULT_CHAT", "DIALECTS", "ChatWire", "Dialect", "TokenWire", "chat_wire", "get", "serving",
           "token_of", "token_wire"]
