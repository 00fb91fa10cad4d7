"""``echo``: ``{"text", "prompt"?, "system"?, "tools"?}`` — say ``text`` back exactly.

A small domain for learning checks on small models (a 135M model copies a 5-digit number
sometimes when sampled, and learns to do it always; see examples/async_grpo.py). The prompt is
``prompt`` (default: "Repeat this <n>-digit number exactly: <text>" for digits, else "Repeat
exactly: <text>"), after an optional ``system`` message. ``tools`` is which of the agent's tools
the model is offered: ``none`` (default: one assistant turn, the shortest prompt), ``submit``
(it may answer through ``submit``), ``all`` (bash, the editor and submit: the agent loop goes on
after each tool call). ``match``: ``exact`` (default) — the ``submit`` answer, else the final
message, equals ``text`` once surrounding whitespace, quotes and final punctuation are stripped;
``contains`` — ``text`` appears in it, not as part of a longer word or number (a sampled 135M
model rarely answers with the number alone, but often says it back inside a sentence).
"""
from __future__ import annotations

from typing import Any, Literal

from prorl_celery.llm import LLMRequest, Turn
from tasks.agent import AgentConfig
from tasks.agent import tools as agent_tools
from tasks.context import StageContext
from tasks.handlers.agentic import AgentTaskHandler, final_answer, mentions
from tasks.handlers.instances import ECHO_TOOL_SETS, check_echo

ToolSet = Literal["none", "submit", "all"]
TOOL_SETS: dict[str, list[dict[str, Any]] | None] = {"none": None, "submit": [agent_tools.SUBMIT],
                                                     "all": agent_tools.ALL}
assert set(TOOL_SETS) == set(ECHO_TOOL_SETS)
_STRIP = " \t\r\n\"'`.!,;:"


def answer_of(text: str | None) -> str:
    return (text or "").strip(_STRIP)


class EchoAgentConfig(AgentConfig):
    """The agent's settings with the instance's tool set instead of all tools."""

    offered: ToolSet = "none"

    def request(self, messages: list[dict[str, Any]], previous: Turn | None, timeout_s: float) -> LLMRequest:
        return super().request(messages, previous, timeout_s).model_copy(update={"tools": TOOL_SETS[self.offered]})


class EchoHandler(AgentTaskHandler):
    name = "echo"
    default_sandbox = {"limits": {"memory_mb": 512, "cpu_s": 30, "nproc": 32}}

    def check_instance(self, instance: dict[str, Any]) -> None:
        check_echo(instance)

    def prompt(self, ctx: StageContext) -> list[dict[str, Any]]:
        text = str(ctx.instance["text"])
        ask = ctx.instance.get("prompt") or (f"Repeat this {len(text)}-digit number exactly: {text}" if text.isdigit()
                                             else f"Repeat exactly: {text}")
        system = ctx.instance.get("system")
        return ([{"role": "system", "content": str(system)}] if system else []) + [{"role": "user", "content": ask}]

    def run(self, ctx: StageContext) -> None:
        if ctx.resumed:
            ctx.sandbox.interrupt()
        ctx.admit()  # the staleness bound: held while the trainer is too far ahead
        config = EchoAgentConfig.model_validate({**ctx.sampling_params, "offered": ctx.instance.get("tools", "none")})
        outcome = ctx.agent(config).run(self.prompt(ctx))
        self.after_run(ctx, outcome)
        ctx.save()

    def score(self, ctx: StageContext) -> dict[str, Any]:
        submitted, text = final_answer(ctx.state)
        given = answer_of(submitted if submitted is not None else text)
        expected = answer_of(str(ctx.instance["text"]))
        if ctx.instance.get("match", "exact") == "contains":
            correct = mentions(given, expected)
        else:
            correct = given == expected
        return {"reward": 1.0 if correct else 0.0, "resolved": correct,
                "eval": {"given": given[:200], "expected": expected, "correct": correct}}
