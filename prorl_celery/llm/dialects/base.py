"""What a server dialect is: a :class:`Dialect` names the server and declares what it serves,
and carries one wire per protocol it speaks: a :class:`~prorl_celery.llm.dialects.chat_wire.ChatWire`
(OpenAI chat completions) and a :class:`TokenWire` (token in, token out). A wire is the dialect's
hooks on the call path: the request body it sends and the answer it reads back.

A wire is built once per process and shared by every call; its hooks must be thread-safe.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from prorl_celery.errors import BackendAborted, LLMRequestRejected, PartialAborted
from prorl_celery.llm.dialects.sampling import Sampling
from prorl_celery.llm.dialects.served import NOTHING, Served
from prorl_celery.llm.models import LLMRequest, PauseApi, Protocol
from prorl_celery.llm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from prorl_celery.llm.dialects.chat_wire import ChatWire

# what a probe hint may be given for: the registration fields the probe refuses (prorl_celery.llm.probe)
PROBE_FIELDS = ("tools", "dialect", "exact_tokens")


class Generated(NamedTuple):
    """A token API's answer as the generate client reads it."""

    response_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    weight_version: str | None = None
    spans: list[dict[str, Any]] | None = None  # vLLM's weight_versions: [{"version", "start", "end"}]
    served: Served = NOTHING  # the routing trace and prefix-cache hit the server reported


def aborted(out: Generated, server: str) -> BackendAborted:
    """The server's abort of a request (a weight update): PartialAborted carrying what it had
    generated (``partial`` is the :class:`Generated` read so far; the client adds the versions);
    a plain BackendAborted when the answer has no usable ids and logprobs."""
    if out.logprobs is None or len(out.logprobs) != len(out.response_ids):
        return BackendAborted(f"{server} aborted the request (no usable partial ids)")
    return PartialAborted(f"{server} aborted the request after {len(out.response_ids)} tokens", out)


def read_logprobs(raw: Any) -> list[float] | None:
    """Floats, or SGLang's ``[logprob, id, text]`` triples, or ``{"logprob": x}`` dicts."""
    if raw is None:
        return None
    out = []
    for item in raw:
        if isinstance(item, dict):
            out.append(float(item["logprob"]))
        elif isinstance(item, (list, tuple)):
            out.append(float(item[0]))
        else:
            out.append(float(item))
    return out


class TokenWire:
    """One server's token API: where it is, the request body, and the answer read back."""

    path: ClassVar[str] = ""
    sampling: ClassVar[Sampling] = Sampling()
    context_margin: ClassVar[int] = 0  # tokens of the window the server will not fill (SGLang: 1)
    logprobs_mode: ClassVar[str | None] = None  # the logprob definition its server reports by default
    streamed: ClassVar[bool] = False  # read as server-sent events (read_events): a cut turn keeps its tokens
    versioned_spans: ClassVar[bool] = False  # answers say which weight version sampled each span
    # fields that ask a server started for it to return each call's MoE routing trace (BackendSpec.routed_experts)
    routed_experts_request: ClassVar[Mapping[str, Any]] = {}

    def body(self, request: LLMRequest, model: str, tok: Tokenizer, prompt: list[int],
             max_tokens: int | None) -> dict[str, Any]:
        """The request body for ``prompt`` (the ids the server continues)."""
        raise NotImplementedError

    def answer(self, data: dict[str, Any]) -> Generated:
        """The answer read whole; raises the pool's exceptions (an abort: :func:`aborted`)."""
        raise NotImplementedError

    def read_events(self, events: Iterator[dict[str, Any]], ids: list[int], logprobs: list[float]) -> Generated:
        """A streamed wire's answer: ``ids`` and ``logprobs`` grow as the events come (the caller
        keeps them when the stream is cut)."""
        raise NotImplementedError

    def at(self, address: str) -> TokenWire:
        """The wire to use for the server at ``address`` (one that refused a field earlier may
        need another); this one by default."""
        return self

    def after_refusal(self, address: str, refused: LLMRequestRejected) -> TokenWire | None:
        """The wire to send the same request with once more after the server at ``address``
        refused it (a field an older version lacks); None: the refusal stands."""
        return None


class Dialect:
    """One LLM server's API, as registered in ``BackendSpec.dialect``: what it serves (its wires'
    protocols, sampling names, logprob mode, streaming, versioned spans), the pause APIs its
    server can offer, and what the registration probe tells an operator it needs."""

    name: ClassVar[str] = ""
    server: ClassVar[str] = ""  # the server it speaks to, as recordings name it ("vllm", "llama.cpp")
    chat: ClassVar[ChatWire | None] = None
    token: ClassVar[TokenWire | None] = None
    pause_apis: ClassVar[frozenset[PauseApi]] = frozenset()  # a server's own pause it can offer
    # what the server must be started with for a probed field (tools, dialect, exact_tokens)
    probe_hints: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def protocols(cls) -> frozenset[Protocol]:
        """The protocols it speaks: one per wire."""
        return frozenset(p for p, wire in ((Protocol.CHAT, cls.chat), (Protocol.GENERATE, cls.token))
                         if wire is not None)
