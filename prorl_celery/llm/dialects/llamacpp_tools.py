"""A forced tool call on llama.cpp's server, the way that server honours one.

Read from llama.cpp's server code (``tools/server/server-common.cpp``,
``common/chat-auto-parser-generator.cpp``) and checked on the xllamacpp build the tests run:

- ``tool_choice`` is a string only (``auto``, ``none``, ``required``); a named function
  (``{"type": "function", ...}``) is logged as a wrong type and treated as ``auto``.
- With ``required`` the server's tool grammar is not lazy, but it still admits free text before the
  first ``<tool_call>`` (``optional(content(until(tool_start)))``): the model may not stop without
  a call, yet it may talk until ``max_tokens``. SmolLM2-135M does exactly that (measured: 40 tokens
  of prose, finish ``length``, no call).
- A request's own GBNF ``grammar`` is refused beside tools unless ``tool_choice`` is ``none``
  ("Cannot use custom grammar constraints with tools."); with ``none`` the template still lists the
  tools in the prompt, the grammar is applied from the first token, and the answer comes back as
  text (no tool parsing), which :func:`prorl_celery.llm.chatml.split_tool_calls` reads.

So for ``required`` or a named function the ``llama.cpp`` chat dialect sends ``tool_choice: none``
and a grammar that admits exactly one Hermes block ``<tool_call>\\n{"name": ..., "arguments":
...}\\n</tool_call>`` — the text the tools template renders for a call in the history — with the
arguments shaped by the tool's JSON schema where it is simple (required properties of scalar types),
any JSON object otherwise. The logprobs stay those of the raw distribution (the grammar masks the
sampler, not the reported logprobs), as with vLLM's guided decoding for ``required``.
"""
from __future__ import annotations

import json
from typing import Any

_JSON_RULES = r'''value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( string ws ":" ws value ( ws "," ws string ws ":" ws value )* )? ws "}"
array ::= "[" ws ( value ( ws "," ws value )* )? ws "]"
string ::= "\"" ( [^"\\\x00-\x1F\x7F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
integer ::= "-"? ( "0" | [1-9] [0-9]* )
number ::= integer ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
boolean ::= "true" | "false"
ws ::= " "?'''
_SCALARS = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean"}


def literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def requested_names(tools: list[dict[str, Any]], tool_choice: Any) -> list[str] | None:
    """The tool names a call must come from when ``tool_choice`` forces one (``required``: any
    tool; a named function: that one), else None."""
    names = [t["function"]["name"] for t in tools if isinstance(t.get("function"), dict) and t["function"].get("name")]
    if tool_choice == "required":
        return names or None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        return [name] if name in names else None
    return None


def _arguments_rule(schema: Any) -> str:
    """A GBNF expression for a call's arguments: for an object schema with properties, its required
    properties first in the schema's order, then any of its optional ones, each value typed by its
    schema where that is a scalar or an enum; any JSON object for every other schema."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return "object"
    props, required = schema.get("properties") or {}, schema.get("required") or []
    if not isinstance(props, dict) or not props or set(required) - set(props):
        return "object"
    member = _optional_member(props, [name for name in props if name not in required])
    if not required:  # member is set: props is not empty
        return f'"{{" ws ( {member} ( ws "," ws {member} )* )? ws "}}"'
    parts = [literal(("{" if i == 0 else ", ") + json.dumps(name) + ": ") + " " + _value_rule(props[name])
             for i, name in enumerate(required)]
    if member:
        parts.append(f'( "," ws {member} )*')
    return " ".join(parts) + ' "}"'


def _optional_member(props: dict[str, Any], optional: list[str]) -> str | None:
    """A GBNF expression for any one of the ``optional`` properties as ``"name": value``."""
    if not optional:
        return None
    return "( " + " | ".join(f'{literal(json.dumps(name))} ws ":" ws {_value_rule(props[name])}'
                             for name in optional) + " )"


def _value_rule(prop: Any) -> str:
    """A property's value: its enum, its scalar type, or any JSON value."""
    prop = prop if isinstance(prop, dict) else {}
    if "enum" in prop and all(isinstance(v, (str, int, float, bool)) for v in prop["enum"] or [None]):
        return "( " + " | ".join(literal(json.dumps(v)) for v in prop["enum"]) + " )"
    return _SCALARS.get(prop.get("type"), "value") if isinstance(prop.get("type"), str) else "value"


def tool_call_grammar(tools: list[dict[str, Any]], names: list[str]) -> str:
    """GBNF admitting exactly one Hermes tool-call block for one of ``names``."""
    by_name = {t["function"]["name"]: t["function"] for t in tools if isinstance(t.get("function"), dict)}
    calls = []
    for i, name in enumerate(names):
        head = literal('<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ')
        calls.append(f"call{i} ::= {head} {_arguments_rule(by_name[name].get('parameters'))} "
                     + literal("}\n</tool_call>"))
    root = "root ::= " + " | ".join(f"call{i}" for i in range(len(names)))
    return "\n".join([root, *calls, _JSON_RULES]) + "\n"


def forced_call(tools: list[dict[str, Any]] | None, tool_choice: Any) -> dict[str, Any]:
    """The body fields that make llama.cpp's server write one tool call now, or {} when
    ``tool_choice`` does not force one (``auto`` and ``none`` go as they are)."""
    names = requested_names(tools or [], tool_choice)
    if not names:
        return {}
    return {"tool_choice": "none", "grammar": tool_call_grammar(tools or [], names), "parallel_tool_calls": False}
