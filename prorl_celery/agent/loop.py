"""The multi-turn loop: ask the policy for a turn, run its tool calls in the sandbox, repeat.

The conversation and every turn are saved in the job's state after each turn, so a run stage
delivered again after its worker died continues from the last saved turn. Every way an episode
ends is recorded as ``finish_reason``: ``submit``, ``stop`` (a reply without tool calls),
``max_turns``, ``max_tokens``, ``context`` (window exhausted), ``format_error`` (too many bad
tool calls in a row) or ``budget`` (the stage's time ran out).
"""
from __future__ import annotations

import time
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from config.settings import get_settings
from prorl_celery.agent import tools
from prorl_celery.agent.editor import Editor, EditorError
from prorl_celery.errors import ContextWindowExceeded, StageBudgetExceeded
from prorl_celery.llm import LLMPool, LLMRequest, Protocol, SamplingParams, Turn

OBSERVATION_LIMIT = 12000


class AgentConfig(BaseModel):
    """Agent settings, read from the job's ``sampling_params`` (the reference system's names work)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    max_turns: int = Field(30, ge=1, validation_alias=AliasChoices("max_turns", "max_iterations"),
                           description="Assistant turns before the episode ends (finish_reason max_turns).")
    max_total_tokens: int | None = Field(None, ge=1, description="Generated tokens over the episode.")
    max_bad_calls: int = Field(3, ge=1, description="Consecutive malformed or unknown tool calls tolerated.")
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = Field(None, ge=1, validation_alias=AliasChoices("max_tokens", "max_output_tokens"),
                                   description="Generated tokens per turn.")
    seed: int | None = None
    tool_choice: str | dict[str, Any] | None = Field(None, description="Chat mode: passed to the server as is "
                                                                      "(\"required\" forces a tool call).")
    token_level_generation: bool | None = Field(None, description="True: generate protocol (token in/out); "
                                                                  "False: chat; None: any backend.")
    tokenizer: str | None = Field(None, validation_alias=AliasChoices("tokenizer", "custom_tokenizer"))
    max_model_len: int | None = Field(None, ge=1)
    enable_thinking: bool | None = None
    llm_timeout_s: float | None = Field(None, gt=0)

    def request(self, messages: list[dict[str, Any]], previous: Turn | None, timeout_s: float) -> LLMRequest:
        protocol = None if self.token_level_generation is None else (
            Protocol.GENERATE if self.token_level_generation else Protocol.CHAT)
        kwargs = None if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        sampling = SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                                  seed=self.seed, **({"tool_choice": self.tool_choice} if self.tool_choice else {}))
        return LLMRequest(messages=messages, tools=tools.ALL, sampling=sampling, protocol=protocol,
                          previous=previous, tokenizer=self.tokenizer, max_model_len=self.max_model_len,
                          chat_template_kwargs=kwargs, timeout_s=timeout_s)


class AgentOutcome(BaseModel):
    finish_reason: str
    answer: str | None = Field(None, description="The submit answer, if the agent submitted one.")
    final_text: str = Field("", description="The last assistant message's text.")


def _clip(text: str) -> str:
    if len(text) <= OBSERVATION_LIMIT:
        return text
    half = OBSERVATION_LIMIT // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


class _Episode:
    """The state of one episode, kept in ``ctx.state["agent"]``."""

    def __init__(self, ctx, first_messages: list[dict[str, Any]]):
        self.ctx = ctx
        self.data = ctx.state.setdefault("agent", {})
        self.data.setdefault("messages", first_messages)
        for key, value in (("turns", []), ("bad_calls", 0), ("llm_s", 0.0), ("actions_s", 0.0),
                           ("history", {}), ("generated", 0)):
            self.data.setdefault(key, value)
        self.turns = [Turn.model_validate(t) for t in self.data["turns"]]

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.data["messages"]

    def add_turn(self, turn: Turn, llm_s: float) -> None:
        self.turns.append(turn)
        self.data["turns"].append(turn.model_dump(mode="json"))
        self.messages.append(turn.message)
        self.data["llm_s"] += llm_s
        self.data["generated"] += len(turn.response_ids or []) or len((turn.content or "").encode())

    def end(self, reason: str, answer: str | None = None) -> AgentOutcome:
        self.data["finish_reason"] = reason
        if answer is not None:
            self.data["answer"] = answer
        self.ctx.save()
        last = next((m for m in reversed(self.messages) if m.get("role") == "assistant"), {})
        return AgentOutcome(finish_reason=reason, answer=self.data.get("answer"),
                            final_text=last.get("content") or "")


def run_agent(ctx, first_messages: list[dict[str, Any]], config: AgentConfig,
              pool: LLMPool | None = None) -> AgentOutcome:
    """Run (or resume) the episode of ``ctx``'s job to its end."""
    pool = pool or LLMPool(ctx.store.redis)
    episode = _Episode(ctx, first_messages)
    if "finish_reason" in episode.data:
        return episode.end(episode.data["finish_reason"])
    editor = Editor(ctx.sandbox, episode.data["history"])
    call_timeout = config.llm_timeout_s or get_settings().llm_call_timeout_s
    while True:
        if len(episode.turns) >= config.max_turns:
            return episode.end("max_turns")
        if config.max_total_tokens and episode.data["generated"] >= config.max_total_tokens:
            return episode.end("max_tokens")
        try:
            ctx.check()
        except StageBudgetExceeded:
            episode.end("budget")
            raise
        previous = episode.turns[-1] if episode.turns else None
        request = config.request(list(episode.messages), previous, max(0.1, min(call_timeout, ctx.remaining())))
        started = time.monotonic()
        try:
            turn = pool.generate(ctx.job_id, request, should_stop=ctx.stopped)
        except ContextWindowExceeded:
            return episode.end("context")
        episode.add_turn(turn, time.monotonic() - started)
        if not turn.tool_calls:
            if turn.format_error:
                _bad(episode, f"Your reply could not be used ({turn.format_error}). Call one of the tools "
                              "bash, str_replace_editor or submit with valid JSON arguments.")
                if episode.data["bad_calls"] >= config.max_bad_calls:
                    return episode.end("format_error")
                ctx.save()
                continue
            return episode.end("stop")
        submitted, all_bad = _act(ctx, episode, editor, turn)
        if submitted is not None:
            return episode.end("submit", submitted)
        episode.data["bad_calls"] = episode.data["bad_calls"] + 1 if all_bad else 0
        if episode.data["bad_calls"] >= config.max_bad_calls:
            return episode.end("format_error")
        ctx.save()


def _bad(episode: _Episode, message: str) -> None:
    episode.data["bad_calls"] += 1
    episode.messages.append({"role": "user", "content": message})


def _act(ctx, episode: _Episode, editor: Editor, turn: Turn) -> tuple[str | None, bool]:
    """Run the turn's tool calls; returns (the submit answer or None, whether every call was bad)."""
    bad = 0
    submitted = None
    for call in turn.tool_calls:
        started = time.monotonic()
        try:
            args = call.args()
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
            if call.name == "submit":
                answer = args.get("answer")
                submitted = "" if answer is None else str(answer)
                observation = "Submitted."
            elif call.name == "bash":
                observation = _bash(ctx, args)
            elif call.name == "str_replace_editor":
                observation = editor(args)
            else:
                raise ValueError(f"unknown tool {call.name!r}; the tools are {sorted(tools.NAMES)}")
        except (ValueError, EditorError) as exc:
            bad += not isinstance(exc, EditorError)
            observation = f"Error: {exc}"
        episode.data["actions_s"] += time.monotonic() - started
        episode.messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name,
                                 "content": _clip(observation)})
        if submitted is not None:
            break
    return submitted, bad == len(turn.tool_calls)


def _bash(ctx, args: dict[str, Any]) -> str:
    command = args.get("command")
    if not isinstance(command, str) or not command.strip():
        raise ValueError("bash needs a non-empty `command`")
    limit = get_settings().action_timeout_s
    wanted = args.get("timeout")
    if isinstance(wanted, (int, float)) and not isinstance(wanted, bool) and wanted > 0:
        limit = min(float(wanted), limit)
    out = ctx.sandbox.exec(command, timeout=max(0.1, min(limit, ctx.remaining())))
    notes = []
    if out.timed_out:
        notes.append(f"[the command timed out after {limit:g}s and was killed]")
    elif out.exit_code not in (0, None):
        notes.append(f"[exit code {out.exit_code}]")
    return out.output + ("\n" + "\n".join(notes) if notes else "")

