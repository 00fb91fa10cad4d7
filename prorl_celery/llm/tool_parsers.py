"""Tool calls read out of a model's generated text, in the format the model was trained to write.

A backend declares its model's format at registration (``BackendSpec.tool_parser``, default
``hermes``); the token-mode client (and so the session gateway) and the chat client, when the
server handed back raw text, read the turn's calls with that parser. Each format is one
:class:`ToolParser` in :data:`PARSERS`:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5/3,
  Hermes, the byte tokenizer's template);
- ``llama3_json``: the whole answer is one or more JSON objects ``{"name": ..., "parameters":
  {...}}`` (``arguments`` accepted too), separated by ``;``, after an optional ``<|python_tag|>``
  (Llama 3.1-3.3, Llama 4's JSON mode);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects (tokenizers
  before v11), or ``[TOOL_CALLS]name[ARGS]{...}`` once per call (v11 and later), the text before
  the first ``[TOOL_CALLS]`` being the content;
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
  </tool_call>``: values are raw text, typed by the tool's JSON schema (a string stays text,
  anything else is read as JSON where it parses);
- ``pythonic``: a Python list of calls ``[name(key=value, ...), ...]`` with literal arguments,
  optionally inside ``<|python_start|>`` / ``<|python_end|>`` (Llama 3.2 / Llama 4 pythonic).

Every parser returns ``(content, calls, malformed)``: the text outside the format's call markup,
the calls it could read (arguments as JSON text), and whether some call markup could not be read
(that call is left out; the turn's ``format_error`` says ``tool_call``). ``render`` writes calls
in the format: what a model trained on it would emit (tests, fakes).

The formats are those of vLLM's tool parsers of the same names (read from their documentation);
the code is this project's own.
"""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prorl_celery.llm import chatml
from prorl_celery.llm.models import ToolCall

Split = tuple[str, list[ToolCall], bool]
Tools = list[dict[str, Any]] | None


@dataclass(frozen=True)
class ToolParser:
    name: str
    split: Callable[[str, Tools], Split]  # (text, the request's tools) -> (content, calls, malformed)
    render: Callable[[list[tuple[str, Any]]], str]  # [(name, arguments)] -> the format's text
    marker: Callable[[str], bool]  # whether a text may hold calls (cheap: the chat client's check)
    always: bool = False  # read calls even when the request sent no tools (the format is unambiguous)


def _call(name: Any, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
    return ToolCall(id=chatml.call_id(), name=str(name), arguments=text)


def _args_of(arguments: Any) -> Any:
    """Arguments given as a dict or as JSON text, as a value to serialise."""
    if isinstance(arguments, str):
        return json.loads(arguments) if arguments.strip() else {}
    return arguments or {}


# -- hermes ------------------------------------------------------------------------------------

def _hermes_split(text: str, tools: Tools) -> Split:
    return chatml.split_tool_calls(text)


def _hermes_render(calls: list[tuple[str, Any]]) -> str:
    return "".join(chatml.render_tool_call(name, args) for name, args in calls)


# -- llama3_json -------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
_LLAMA_START = re.compile(r'\s*\{\s*"name"\s*:')
_DECODER = json.JSONDecoder()


def _llama3_split(text: str, tools: Tools) -> Split:
    at = text.find(PYTHON_TAG)
    if at >= 0:
        before, rest = text[:at], text[at + len(PYTHON_TAG):]
    elif _LLAMA_START.match(text):
        before, rest = "", text
    else:
        return text, [], False  # plain text (a JSON answer without a "name" first is not a call)
    calls: list[ToolCall] = []
    pos, n = 0, len(rest)
    while True:
        while pos < n and (rest[pos].isspace() or rest[pos] == ";"):
            pos += 1
        if pos >= n:
            return before, calls, False
        try:
            obj, pos = _DECODER.raw_decode(rest, pos)
        except ValueError:
            return before, calls, True
        args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, (dict, type(None))):
            return before, calls, True
        calls.append(_call(obj["name"], args or {}))


def _llama3_render(calls: list[tuple[str, Any]]) -> str:
    return "; ".join(json.dumps({"name": name, "parameters": _args_of(args)}) for name, args in calls)


# -- mistral -----------------------------------------------------------------------------------

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def _mistral_split(text: str, tools: Tools) -> Split:
    at = text.find(TOOL_CALLS)
    if at < 0:
        return text, [], False
    content, calls, malformed = text[:at], [], False
    for part in text[at + len(TOOL_CALLS):].split(TOOL_CALLS):
        part = part.strip()
        try:
            if part.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
                items, end = _DECODER.raw_decode(part)
                if not isinstance(items, list) or part[end:].strip():
                    raise ValueError("not one list of calls")
                for item in items:
                    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                        raise ValueError("a call without a name")
                    calls.append(_call(item["name"], item.get("arguments") or {}))
            else:  # name[ARGS]{...} (v11+), maybe name[CALL_ID]id[ARGS]{...}
                head, sep, raw = part.partition(ARGS)
                name = head.partition(CALL_ID)[0].strip()
                if not sep or not name:
                    raise ValueError("no [ARGS] after the name")
                args, end = _DECODER.raw_decode(raw.strip())
                if not isinstance(args, dict) or raw.strip()[end:].strip():
                    raise ValueError("arguments are not one JSON object")
                calls.append(_call(name, args))
        except ValueError:
            malformed = True
    return content, calls, malformed


def _mistral_render(calls: list[tuple[str, Any]]) -> str:
    return TOOL_CALLS + json.dumps([{"name": name, "arguments": _args_of(args)} for name, args in calls])


# -- qwen3_coder -------------------------------------------------------------------------------

_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_QWEN_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_QWEN_PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


def _schema_types(tools: Tools, name: str) -> dict[str, Any]:
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or fn.get("input_schema") or {}).get("properties") or {}
            return {key: (spec or {}).get("type") for key, spec in props.items() if isinstance(spec, dict)}
    return {}


def _qwen_value(raw: str, kind: Any) -> Any:
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value  # as the model wrote it: the tool decides


def _qwen_function(body: str, tools: Tools) -> ToolCall | None:
    match = _QWEN_FUNCTION.fullmatch(body.strip())
    if match is None:
        return None
    name, inner = match.group(1), match.group(2)
    types = _schema_types(tools, name)
    args = {key: _qwen_value(raw, types.get(key)) for key, raw in _QWEN_PARAM.findall(inner)}
    if _QWEN_PARAM.sub("", inner).strip():  # text between parameters, or an unclosed one
        return None
    return _call(name, args)


def _qwen3_coder_split(text: str, tools: Tools) -> Split:
    calls, malformed = [], False
    for body in _QWEN_BLOCK.findall(text):
        call = _qwen_function(body, tools)
        if call is None:
            malformed = True
        else:
            calls.append(call)
    content = _QWEN_BLOCK.sub("", text)
    if "<tool_call>" in content or "<function=" in content:  # a block never closed
        malformed = True
        content = content[:min(i for i in (content.find("<tool_call>"), content.find("<function=")) if i >= 0)]
    return content, calls, malformed


def _qwen3_coder_render(calls: list[tuple[str, Any]]) -> str:
    out = []
    for name, args in calls:
        params = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
                         for key, value in _args_of(args).items())
        out.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
    return "\n".join(out)


# -- pythonic ----------------------------------------------------------------------------------

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_PY_START = re.compile(r"\s*\[\s*[A-Za-z_][\w.]*\s*\(")


def _pythonic_split(text: str, tools: Tools) -> Split:
    body, before, after = text, "", ""
    if PYTHON_START in text:
        before, _, body = text.partition(PYTHON_START)
        body, _, after = body.partition(PYTHON_END)
    elif not _PY_START.match(text):
        return text, [], False
    try:
        tree = ast.parse(body.strip(), mode="eval").body
        if not isinstance(tree, ast.List):
            raise ValueError("not a list")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args:
                raise ValueError("not a call with keyword arguments")
            calls.append(_call(ast.unparse(node.func), {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}))
    except (SyntaxError, ValueError, TypeError):
        return before + after, [], True
    return before + after, calls, False


def _pythonic_render(calls: list[tuple[str, Any]]) -> str:
    parts = [f"{name}({', '.join(f'{k}={v!r}' for k, v in _args_of(args).items())})" for name, args in calls]
    return f"[{', '.join(parts)}]"


PARSERS: dict[str, ToolParser] = {p.name: p for p in (
    ToolParser("hermes", _hermes_split, _hermes_render, lambda t: chatml.TOOL_CALL in t, always=True),
    ToolParser("llama3_json", _llama3_split, _llama3_render, lambda t: PYTHON_TAG in t or bool(_LLAMA_START.match(t))),
    ToolParser("mistral", _mistral_split, _mistral_render, lambda t: TOOL_CALLS in t),
    ToolParser("qwen3_coder", _qwen3_coder_split, _qwen3_coder_render, lambda t: "<function=" in t),
    ToolParser("pythonic", _pythonic_split, _pythonic_render,
               lambda t: PYTHON_START in t or bool(_PY_START.match(t))),
)}
DEFAULT = "hermes"


def register(parser: ToolParser) -> None:
    """Add (or replace) a format: an operator's own model family."""
    PARSERS[parser.name] = parser


def get(name: str | None) -> ToolParser:
    """The parser of ``name`` (None: the default, hermes); KeyError for an unknown name."""
    return PARSERS[name or DEFAULT]


def split(name: str | None, text: str, tools: Tools) -> Split:
    """``text``'s calls in format ``name``; a format other than hermes reads calls only when the
    request sent tools (a JSON answer or a list is not a call when there was nothing to call)."""
    parser = get(name)
    if not tools and not parser.always:
        return text, [], False
    return parser.split(text, tools)
