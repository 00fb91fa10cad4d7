"""The agent's tools run against a :class:`~tasks.agent.base.Sandbox`: ``bash``,
``str_replace_editor`` and ``submit``. A malformed call (bad JSON, an unknown tool, a bash call
without a command) is *bad* and counts towards ``max_bad_calls``; an editor refusal is an
ordinary observation."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prorl_celery.llm.models import ToolCall, Turn
from tasks.agent import tools
from tasks.agent.base import Control, Sandbox
from tasks.agent.editor import Editor, EditorError
from tasks.agent.episode import Episode

OBSERVATION_LIMIT = 12000


@dataclass
class Acted:
    submitted: str | None  # the submit answer ("" without one), None when the agent did not submit
    all_bad: bool


def clip(text: str) -> str:
    if len(text) <= OBSERVATION_LIMIT:
        return text
    half = OBSERVATION_LIMIT // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


class Actions:
    def __init__(self, sandbox: Sandbox, editor: Editor, control: Control, action_timeout_s: float):
        self.sandbox = sandbox
        self.editor = editor
        self.control = control
        self.action_timeout_s = action_timeout_s

    def run(self, episode: Episode, turn: Turn) -> Acted:
        """Run the turn's tool calls in order, each result a ``tool`` message; stop at a submit."""
        bad = 0
        for call in turn.tool_calls:
            started = time.monotonic()
            submitted = None
            try:
                submitted, observation = self._one(call)
            except (ValueError, EditorError) as exc:
                bad += not isinstance(exc, EditorError)
                observation = f"Error: {exc}"
            episode.add_observation({"role": "tool", "tool_call_id": call.id, "name": call.name,
                                     "content": clip(observation)}, time.monotonic() - started)
            if submitted is not None:
                return Acted(submitted, False)
        return Acted(None, bad == len(turn.tool_calls))

    def _one(self, call: ToolCall) -> tuple[str | None, str]:
        args = call.args()
        if not isinstance(args, dict):
            raise ValueError("arguments must be a JSON object")
        if call.name == "submit":
            answer = args.get("answer")
            return ("" if answer is None else str(answer)), "Submitted."
        if call.name == "bash":
            return None, self._bash(args)
        if call.name == "str_replace_editor":
            return None, self.editor(args)
        raise ValueError(f"unknown tool {call.name!r}; the tools are {sorted(tools.NAMES)}")

    def _bash(self, args: dict[str, Any]) -> str:
        command = args.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ValueError("bash needs a non-empty `command`")
        limit = self.action_timeout_s
        wanted = args.get("timeout")
        if isinstance(wanted, (int, float)) and not isinstance(wanted, bool) and wanted > 0:
            limit = min(float(wanted), limit)
        out = self.sandbox.exec(command, timeout=max(0.1, min(limit, self.control.remaining())))
        notes = []
        if out.timed_out:
            notes.append(f"[the command timed out after {limit:g}s and was killed]")
        elif out.exit_code not in (0, None):
            notes.append(f"[exit code {out.exit_code}]")
        return out.output + ("\n" + "\n".join(notes) if notes else "")
