"""Tokenizers for token mode: a ``Tokenizer`` protocol, the built-in byte-level fake (lossless,
no downloads) and Hugging Face ``transformers`` tokenizers (optional dependency).

:func:`continuation_ids` is how a turn's prompt grows without re-tokenising the history: it
renders only the new messages, as the model's own chat template places them after an assistant
turn, by diffing two renders of a fixed dummy conversation.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
import weakref
from typing import Any, Protocol, runtime_checkable

from prorl_celery.backoff import Backoff, wait
from prorl_celery.errors import InvalidRequest, UnknownPlugin
from prorl_celery.llm import chatml

log = logging.getLogger(__name__)


@runtime_checkable
class Tokenizer(Protocol):
    """What token mode needs of a tokenizer."""

    stop_ids: frozenset[int]
    """Token ids that end an assistant turn (EOS, end of message)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; the chat template's special tokens are 256 and up."""

    SPECIAL = {token: 256 + i for i, token in enumerate(chatml.SPECIAL_TOKENS)}
    _SPLIT = re.compile("(" + "|".join(re.escape(t) for t in chatml.SPECIAL_TOKENS) + ")")

    def __init__(self) -> None:
        self.by_id = {i: t for t, i in self.SPECIAL.items()}
        self.stop_ids = frozenset({self.SPECIAL[chatml.IM_END], self.SPECIAL[chatml.EOT]})
        self.vocab_size = 256 + len(self.SPECIAL)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._SPLIT.split(text):
            if piece in self.SPECIAL:
                ids.append(self.SPECIAL[piece])
            elif piece:
                ids.extend(piece.encode())
        return ids

    def decode(self, ids: list[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode(errors="replace"))
            run = bytearray()
            out.append(self.by_id.get(i, ""))
        out.append(run.decode(errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        return self.encode(chatml.render(messages, tools, add_generation_prompt))


class HFTokenizer:
    """A ``transformers`` tokenizer and its chat template (``pip install transformers``; torch is
    not needed). ``name`` is a hub name or a local directory made by ``save_pretrained``."""

    STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>")

    def __init__(self, name: str):
        self.tok = _auto_tokenizer(name).from_pretrained(name)
        vocab = self.tok.get_vocab()
        stops = {self.tok.eos_token_id, *(vocab[t] for t in self.STOP_TOKENS if t in vocab)}
        self.stop_ids = frozenset(i for i in stops if isinstance(i, int))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        # Render, then encode: what transformers does inside, minus its return type, which changed
        # from a list of ids (4.x) to a BatchEncoding (5.x).
        text = self.tok.apply_chat_template(template_messages(messages), tools=tools or None, tokenize=False,
                                            add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text)


def _arguments_object(arguments: Any) -> Any:
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template gets what the model wrote
    return parsed if isinstance(parsed, dict) else arguments


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as vLLM's and SGLang's chat serving hand them to a chat template: an assistant
    message's tool-call ``arguments`` (OpenAI's JSON string) parsed into an object (empty: ``{}``),
    so ``tool_call.arguments | tojson`` and ``arguments | items`` render the object, not a quoted
    string. Messages with tool calls are copied; ``messages`` is not changed."""
    out = list(messages)
    for i, message in enumerate(out):
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if not isinstance(calls, list) or not calls:
            continue
        fixed = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and not isinstance(fn.get("arguments"), dict):
                call = {**call, "function": {**fn, "arguments": _arguments_object(fn.get("arguments"))}}
            fixed.append(call)
        out[i] = {**message, "tool_calls": fixed}
    return out


BUILTIN = {"byte": ByteTokenizer, "prorl-fake-byte": ByteTokenizer}

LOAD_ATTEMPTS = 3
LOAD_BACKOFF_S = 0.5
_loaded: dict[str, Tokenizer] = {}
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
_import_lock = threading.Lock()


def get_tokenizer(name: str | None) -> Tokenizer:
    """``byte`` (also the fake server's model name ``prorl-fake-byte``) or a Hugging Face name.

    Loaded once per process: the first caller of a name builds it under that name's lock while
    later callers wait for it (a worker's ``run`` threads all ask at once when it starts; an
    ``lru_cache`` let each build its own, and their concurrent first imports of ``transformers``
    failed). A failure is not cached: the next call tries again."""
    key = name or "byte"
    tok = _loaded.get(key)
    if tok is not None:
        return tok
    with _locks_guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        tok = _loaded.get(key)
        if tok is None:
            tok = BUILTIN[key]() if key in BUILTIN else _load_hf(key)
            _loaded[key] = tok
    return tok


def _load_hf(name: str) -> Tokenizer:
    """An :class:`HFTokenizer`, tried ``LOAD_ATTEMPTS`` times: an ``ImportError`` other than the
    package being absent, or an ``OSError`` (a file being written, a busy disk), can pass; what
    cannot is raised as what it is."""
    for attempt in range(1, LOAD_ATTEMPTS + 1):
        try:
            return HFTokenizer(name)
        except UnknownPlugin:
            raise
        except (ImportError, OSError) as exc:
            if attempt == LOAD_ATTEMPTS:
                raise InvalidRequest(f"tokenizer {name!r} could not be loaded ({LOAD_ATTEMPTS} attempts): "
                                     f"{type(exc).__name__}: {exc}", field="tokenizer") from exc
            log.warning("loading tokenizer %r failed (%s: %s); attempt %d of %d", name, type(exc).__name__,
                        exc, attempt + 1, LOAD_ATTEMPTS)
            wait(Backoff(LOAD_BACKOFF_S, 4 * LOAD_BACKOFF_S).pause(attempt))
        except Exception as exc:  # noqa: BLE001 - a bad name or directory: say so, with the cause
            raise InvalidRequest(f"tokenizer {name!r} could not be loaded: {type(exc).__name__}: {exc}",
                                 field="tokenizer") from exc
    raise AssertionError("unreachable")


def _auto_tokenizer(name: str) -> Any:
    """``transformers.AutoTokenizer``, imported by one thread at a time (the package's lazy
    modules are not safe to initialise from two threads at once). Only a missing package is
    reported as missing; any other import error is raised as itself."""
    with _import_lock:
        try:
            from transformers import AutoTokenizer
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] == "transformers":
                raise UnknownPlugin(f"tokenizer {name!r} needs the optional 'transformers' package "
                                    "(pip install transformers)") from exc
            raise
    return AutoTokenizer


_DUMMY = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
_DUMMY_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], list[int]]] = weakref.WeakKeyDictionary()
_DUMMY_CACHE_SIZE = 64  # per tokenizer


def _dummy_ids(tok: Tokenizer, tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> list[int]:
    """The dummy conversation rendered with ``tools`` (read-only): the same for every turn of a
    rollout, so rendered once per tokenizer, tools and template arguments, not twice a turn (a
    harness's tools are ~100 kB of JSON in the system prompt: tens of ms to tokenise)."""
    key = (json.dumps(tools, sort_keys=True) if tools else "",
           json.dumps(kwargs, sort_keys=True, default=str) if kwargs else "")
    try:
        cache = _DUMMY_CACHE.setdefault(tok, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: rendered each time
        cache = {}
    ids = cache.get(key)
    if ids is None:
        ids = tok.apply_chat_template(_DUMMY, tools=tools, add_generation_prompt=False, **kwargs)
        if len(cache) >= _DUMMY_CACHE_SIZE:
            cache.clear()
        cache[key] = ids
    return ids


def continuation_ids(tok: Tokenizer, new_messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     **kwargs: Any) -> list[int]:
    """Ids of ``new_messages`` plus the generation prompt, as the template renders them right
    after a finished assistant turn."""
    base = _dummy_ids(tok, tools, kwargs)
    full = tok.apply_chat_template(_DUMMY + list(new_messages), tools=tools, add_generation_prompt=True,
                                   **kwargs)
    if full[: len(base)] != base:
        at = next((i for i, (a, b) in enumerate(zip(base, full)) if a != b), len(full))
        raise InvalidRequest(
            "the chat template is not suffix-stable: rendering new messages after an assistant turn "
            f"changes what it rendered before them (from token {at}: {tok.decode(base[at:at + 12])!r} "
            f"becomes {tok.decode(full[at:at + 12])!r}), so token mode cannot append the new messages' "
            "ids to the previous turn's; use a template that only appends (chat_template_kwargs, "
            "another tokenizer) or the chat protocol", field="tokenizer")
    return full[len(base):]


def turn_closing_ids(tok: Tokenizer, response_ids: list[int], tools: list[dict[str, Any]] | None,
                     **kwargs: Any) -> list[int]:
    """What the template puts after a generated assistant turn before the next message: the stop
    token if the model did not emit one (cut off by length), then whatever follows it (``\\n``)."""
    base = _dummy_ids(tok, tools, kwargs)
    stop_at = max((i for i, t in enumerate(base) if t in tok.stop_ids), default=None)
    if stop_at is None:
        return []
    tail = base[stop_at + 1:]
    ended = bool(response_ids) and response_ids[-1] in tok.stop_ids
    return tail if ended else [base[stop_at], *tail]
