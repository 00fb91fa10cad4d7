"""The fake LLM's oracle for harnesses (a test and demo tool, not a model): it plays the fixture
tasks in each harness's own format, as the harness's prompt shows it.

mini-swe-agent (its instance template asks for ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``):
the SWE fixture's steps as ``bash`` tool calls with a ``command``, then that echo. Claude Code
(its ``Bash`` tool in the system prompt): the same steps as ``Bash`` tool uses, then a final text;
Codex (``exec_command``): the same as ``exec_command`` calls; the example task ``mcp-skills`` in
their MCP and skill tools (:mod:`prorl_celery.fakes.mcp_oracle`); the ``lookup`` task as
examples/lookup_agent.py asks it (the named file, then the code it was shown). Math fixture tasks: one shell check,
then the answer in ``\boxed{}`` (asked with no tools at all, as a plain chat agent asks: the answer
at once). Anything else
goes to :func:`prorl_celery.fakes.oracle.reply`.

Start a fake server with it: ``prorl-celery fake-llm --policy oracle:prorl_celery.fakes.harness_oracle:reply``.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from prorl_celery.fakes import mcp_oracle, oracle
from prorl_celery.fakes.llm.policies import Reply
from prorl_celery.fakes.problems import MATH
from prorl_celery.llm.chatml import text_of

MINI_SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
CLAUDE_BASH = '"name": "Bash"'  # how the byte tokenizer's template lists Claude Code's Bash tool
CODEX_EXEC = '"name": "exec_command"'  # and Codex's shell tool
LOOKUP_TARGET = re.compile(r"The code you need is in (\S+?)\. ")  # tasks/handlers/lookup.py's prompt
LOOKUP_SHOWN = re.compile(r" says:\n.*?\b(\d{3,})\b", re.S)  # examples/lookup_agent.py's observation


def _math(text: str, step: int, check: Reply, final: Reply) -> Reply | None:
    """A math fixture task: one check with the harness's shell tool, then the boxed answer."""
    for task in MATH:
        if task["problem"] in text:
            if step == 0:
                return check
            return final.model_copy(update={"content": f"The answer is \\boxed{{{task['answer']}}}."})
    return None


def _mini(messages: list[dict[str, Any]], text: str) -> Reply | None:
    step = oracle._step(messages)
    math = _math(text, step, oracle._call("bash", command="python3 -c \"print('checking')\""),
                 oracle._call("bash", command=f"echo {MINI_SUBMIT}"))
    if math is not None:
        return math
    script = oracle.harbor_script(text)
    if script is not None:
        return oracle._call("bash", command=script if step == 0 else f"echo {MINI_SUBMIT}")
    for task in oracle._swe_tasks():
        if task["problem_statement"] in text:
            answer = oracle._swe(task, step)
            if answer.tool_calls and answer.tool_calls[0].name == "submit":
                return oracle._call("bash", command=f"echo {MINI_SUBMIT}")
            return answer
    return None


def _claude_code(messages: list[dict[str, Any]], text: str, tools: list[dict[str, Any]] | None) -> Reply | None:
    mcp = mcp_oracle.reply(messages, tools, lambda command: oracle._call("Bash", command=command, description="answer"),
                           "claude_code")
    if mcp is not None:
        return mcp
    step = oracle._step(messages)
    math = _math(text, step, oracle._call("Bash", command="python3 -c \"print('checking')\"", description="check"),
                 Reply())
    if math is not None:
        return math
    return _swe_with(text, step, lambda command: oracle._call("Bash", command=command,
                                                               description="work on the issue"))


def _codex(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Reply | None:
    mcp = mcp_oracle.reply(messages, tools, lambda command: oracle._call("exec_command", cmd=command), "codex")
    if mcp is not None:
        return mcp
    step = oracle._step(messages)
    text = "\n".join(text_of(m.get("content")) for m in messages if m.get("role") == "user")
    shell = oracle._call("exec_command", cmd="python3 -c \"print('checking')\"")
    math = _math(text, step, shell, Reply())
    if math is not None:
        return math
    return _swe_with(text, step, lambda command: oracle._call("exec_command", cmd=command))


def _swe_with(text: str, step: int, shell: Callable[[str], Reply]) -> Reply | None:
    """The oracle's SWE episode (or an example Harbor task's solve.sh) in a harness's own shell
    tool (``shell(command)``); where the oracle would submit, a harness just says it is done."""
    script = oracle.harbor_script(text)
    if script is not None:
        return shell(script) if step == 0 else Reply(content="The task is done.")
    for task in oracle._swe_tasks():
        if task["problem_statement"] in text:
            answer = oracle._swe(task, step)
            if answer.tool_calls and answer.tool_calls[0].name == "submit":
                return Reply(content="The issue is fixed.")
            return shell(answer.tool_calls[0].arguments["command"])
    return None


def _system(messages: list[dict[str, Any]]) -> str:
    return text_of(messages[0].get("content")) if messages and messages[0].get("role") == "system" else ""


def reply(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Reply | None:
    text = oracle._first_user(messages)
    if MINI_SUBMIT in text:
        return _mini(messages, text)
    if CLAUDE_BASH in _system(messages):  # Claude Code's main loop (its tools are in the system prompt)
        return _claude_code(messages, text, tools)
    if CODEX_EXEC in _system(messages):  # Codex (its task is not its first user message)
        return _codex(messages, tools)
    if not tools:  # a plain chat agent (a command harness with no tools): a math answer in its text
        answer = _math(text, 1, Reply(), Reply()) or _lookup(messages, text)
        if answer is not None:
            return answer
    return oracle.reply(messages, tools)


def _lookup(messages: list[dict[str, Any]], text: str) -> Reply | None:
    """The ``lookup`` task as examples/lookup_agent.py asks it: the file the task names, then the
    code the file it was shown holds."""
    target = LOOKUP_TARGET.search(text)
    if target is None:
        return None
    if not any(m.get("role") == "assistant" for m in messages):
        return Reply(content=target.group(1))
    shown = LOOKUP_SHOWN.search(text_of(messages[-1].get("content")) or "")
    return Reply(content=shown.group(1) if shown else "I do not know.")
