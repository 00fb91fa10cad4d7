"""``check_dialect``: the conformance check every dialect passes (Gymnasium's ``check_env`` for
LLM server dialects).

Two halves, as for sandbox runtimes. :func:`check_dialect` is static and runs whenever the
registry loads a dialect class: its declarations are well formed and its wires' hooks take the
arguments the clients pass. :func:`check_recorded` holds a dialect to exchanges recorded from its
real server (``tests/fixtures/recorded``): every answer the server gave on one of the dialect's
paths is read into ids with one logprob each, and the sampling names the dialect sends are names
that server was seen to take.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from prorl_celery.errors import UnknownPlugin
from prorl_celery.llm.dialects.base import PROBE_FIELDS, Generated, TokenWire
from prorl_celery.llm.dialects.chat_wire import ChatWire
from prorl_celery.llm.dialects.sampling import Sampling
from prorl_celery.llm.models import LLMRequest, PauseApi, SamplingParams

# each wire's hooks and the arguments the clients pass them, in order (besides ``self``)
CHAT_HOOKS = {"messages": ("request",), "extra": ("body", "request"), "body": ("request", "model", "max_tokens"),
              "answer": ("data", "request", "tool_parser")}
TOKEN_HOOKS = {"body": ("request", "model", "tok", "prompt", "max_tokens"), "answer": ("data",),
               "at": ("address",), "after_refusal": ("address", "refused")}
FINISH_REASONS = ("stop", "length", "tool_calls")
_conformant: set[type] = set()


def _call_problem(obj: Any, method: str, args: tuple[str, ...]) -> str | None:
    func = getattr(obj, method, None)
    if not callable(func):
        return f"no method {method}"
    try:
        inspect.signature(func).bind(*args)
    except TypeError as exc:
        return f"{method}({', '.join(args)}) cannot be called: {exc}"
    return None


def _wire_problems(label: str, wire: Any, kind: type, hooks: dict[str, tuple[str, ...]]) -> list[str]:
    """What is wrong with one wire: its base, path, sampling, logprob mode and hooks."""
    if not isinstance(wire, kind):
        return [f"{label} is not a {kind.__name__}"]
    found = [f"{label}: {p}" for method, args in hooks.items() if (p := _call_problem(wire, method, args))]
    if not (isinstance(wire.path, str) and wire.path.startswith("/")):
        found.append(f"{label}: path {wire.path!r} is not a path")
    if not isinstance(wire.sampling, Sampling):
        found.append(f"{label}: sampling is not a Sampling")
    if wire.logprobs_mode is not None and not isinstance(wire.logprobs_mode, str):
        found.append(f"{label}: logprobs_mode is not a str")
    return found


def _token_problems(wire: TokenWire) -> list[str]:
    found = []
    if not isinstance(wire.context_margin, int) or wire.context_margin < 0:
        found.append("token: context_margin is not an int >= 0")
    if wire.streamed and (p := _call_problem(wire, "read_events", ("events", "ids", "logprobs"))):
        found.append(f"token: streamed, but {p}")
    if type(wire).read_events is TokenWire.read_events and wire.streamed:
        found.append("token: streamed, but read_events is not implemented")
    return found


def _problems(cls: type) -> list[str]:
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        return ["no name"]
    chat, token = getattr(cls, "chat", None), getattr(cls, "token", None)
    found = [] if chat is not None or token is not None else ["no wire: neither chat nor token"]
    if chat is not None:
        found += _wire_problems("chat", chat, ChatWire, CHAT_HOOKS)
    if token is not None:
        found += _wire_problems("token", token, TokenWire, TOKEN_HOOKS) or _token_problems(token)
    if not all(isinstance(api, PauseApi) and api is not PauseApi.NONE for api in getattr(cls, "pause_apis", ())):
        found.append("pause_apis holds something other than vllm or sglang")
    hints = getattr(cls, "probe_hints", {})
    if not all(field in PROBE_FIELDS and isinstance(hint, str) for field, hint in dict(hints).items()):
        found.append(f"probe_hints must map some of {', '.join(PROBE_FIELDS)} to str")
    return found


def check_dialect(cls: type) -> None:
    """Raise :class:`UnknownPlugin` when ``cls`` cannot serve as a dialect, naming each problem."""
    if cls in _conformant:
        return
    problems = _problems(cls)
    if problems:
        raise UnknownPlugin(f"LLM dialect {cls.__module__}:{cls.__qualname__} does not conform: "
                            + "; ".join(problems))
    _conformant.add(cls)


# -- recorded exchanges -----------------------------------------------------------------------
def _read(cls: type, path: str, request: dict[str, Any], answer: dict[str, Any]) -> Generated | None:
    """The dialect's reading of a 200 answer on ``path`` (None: no wire of it has that path)."""
    if cls.token is not None and path == cls.token.path:
        return cls.token.answer(answer)
    if cls.chat is not None and path == cls.chat.path:
        got = cls.chat.answer(answer, LLMRequest(messages=request["messages"], tools=request.get("tools")), None)
        return Generated(got.response_ids or [], got.logprobs if got.response_ids else None, got.finish_reason)
    return None


def _reading_problem(cls: type, record: dict[str, Any]) -> str | None:
    request = record["request"]
    try:
        out = _read(cls, request["path"], request["body"] or {}, record["response"])
    except Exception as exc:  # noqa: BLE001 - whatever the reading raises is the finding
        return f"reading raised {type(exc).__name__}: {exc}"
    if out is None:
        return None
    if out.logprobs is not None and len(out.logprobs) != len(out.response_ids):
        return f"{len(out.logprobs)} logprobs for {len(out.response_ids)} ids"
    if out.finish_reason not in FINISH_REASONS:
        return f"finish reason {out.finish_reason!r}"
    return None


def _sent_names(cls: type) -> dict[str, set[str]]:
    """The sampling names each wire sends for the full set, by path."""
    request = LLMRequest(messages=[{"role": "user", "content": "hi"}],
                         sampling=SamplingParams(top_k=20, seed=1, stop=["x"], max_tokens=4))
    names = {}
    for wire, chat in ((cls.chat, True), (cls.token, False)):
        if wire is not None:
            names[wire.path] = set(wire.sampling.body(request, 4, chat=chat)) - {"seed", "sampling_seed", "stop"}
    return names


def check_recorded(cls: type, records: Iterable[dict[str, Any]]) -> list[str]:
    """What ``cls`` gets wrong against ``records`` (``{"server", "request": {"method", "path",
    "body"}, "status", "response"}``, as recorded from a real server): each 200 answer of its
    server on one of its paths must read into ids with one logprob each and a finish reason; each
    sampling name it sends must appear in a request that server answered with 200 on that path
    (the body's top level, or its ``sampling_params``). The seed and the stop strings are left out
    (the recordings hold them only where the server's version took them). Empty: it conforms."""
    mine = [r for r in records if str(r.get("server", "")).split(" ")[0] == cls.server and "note" not in r]
    sent, taken = _sent_names(cls), {path: set() for path in _sent_names(cls)}
    found = []
    for record in mine:
        path, body = record["request"]["path"], record["request"].get("body") or {}
        if record["status"] != 200 or path not in sent:
            continue
        taken[path] |= set(body) | set(body.get("sampling_params") or {})
        if problem := _reading_problem(cls, record):
            found.append(f"{path} ({record.get('name', 'recorded')}): {problem}")
    for path, names in sent.items():
        if taken[path] and (unseen := names - taken[path]):
            found.append(f"{path}: sends {', '.join(sorted(unseen))}, never seen taken by {cls.server}")
    return found
