"""The ChatML-style chat template the built-in byte tokenizer uses, its inverse, and Hermes-style
tool-call parsing (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, as Qwen writes them).
"""
from __future__ import annotations

import json
import re
import random
from typing import Any

from prorl_celery.llm.models import ToolCall

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = (IM_START, IM_END, EOT, TOOL_CALL, TOOL_CALL_END)

_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL) + r"(.*?)" + re.escape(TOOL_CALL_END), re.S)
_MESSAGE_RE = re.compile(re.escape(IM_START) + r"(\w+)\n(.*?)" + re.escape(IM_END) + r"\n?", re.S)


def text_of(content: Any) -> str:
    """OpenAI content (a string, None, or a list of parts) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def render_tool_call(name: str, arguments: Any) -> str:
    args = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else arguments
    return f"{TOOL_CALL}\n{json.dumps({'name': name, 'arguments': args or {}})}\n{TOOL_CALL_END}"


def render_message(message: dict[str, Any]) -> str:
    body = text_of(message.get("content"))
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        body += render_tool_call(fn["name"], fn.get("arguments"))
    return f"{IM_START}{message['role']}\n{body}{IM_END}\n"


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = True) -> str:
    messages = list(messages)
    if tools:
        listing = "\n".join(json.dumps(tool, sort_keys=True) for tool in tools)
        block = f"\n\n# Tools\n<tools>\n{listing}\n</tools>"
        if messages and messages[0].get("role") == "system":
            messages[0] = {"role": "system", "content": text_of(messages[0].get("content")) + block}
        else:
            messages.insert(0, {"role": "system", "content": block.lstrip()})
    text = "".join(render_message(m) for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def parse(text: str) -> list[dict[str, Any]]:
    """The messages of a rendered conversation (the open generation prompt is dropped)."""
    out = []
    for role, body in _MESSAGE_RE.findall(text):
        content, calls, _ = split_tool_calls(body)
        message: dict[str, Any] = {"role": role, "content": content}
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        out.append(message)
    return out


def call_id() -> str:
    """A tool call's id: unique in its conversation, not a secret (no urandom syscall per call)."""
    return f"call_{random.getrandbits(48):012x}"


def split_tool_calls(text: str) -> tuple[str, list[ToolCall], bool]:
    """(content without the tool-call blocks, the tool calls, whether any block was malformed)."""
    calls: list[ToolCall] = []
    malformed = False
    for raw in _TOOL_CALL_RE.findall(text):
        try:
            data = json.loads(raw)
            name, args = data["name"], data.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            malformed = True
            continue
        arguments = args if isinstance(args, str) else json.dumps(args)
        calls.append(ToolCall(id=call_id(), name=str(name), arguments=arguments))
    content = _TOOL_CALL_RE.sub("", text)
    if TOOL_CALL in content:  # an opened block that never closed
        malformed = True
    return content, calls, malformed
