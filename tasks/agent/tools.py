"""The agent's tools as OpenAI function schemas: ``bash``, ``str_replace_editor`` and ``submit``."""
from __future__ import annotations

from typing import Any


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


BASH = _function(
    "bash", "Run a shell command in the sandbox's persistent shell (the working directory and exported "
            "variables carry over between calls). Returns its output and exit code.",
    {"command": {"type": "string", "description": "The command line to run."},
     "timeout": {"type": "integer", "description": "Seconds before the command is killed."}},
    ["command"])

EDITOR = _function(
    "str_replace_editor", "View, create and edit files. `view` shows a file with line numbers (or lists a "
                          "directory); `create` writes a new file; `str_replace` replaces one exact, unique "
                          "occurrence of old_str; `insert` adds new_str after line insert_line; `undo_edit` "
                          "reverts the last edit of the file. Files over 4 MiB are refused (use bash to look at "
                          "parts of them); only files under the workspace can be written.",
    {"command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
     "path": {"type": "string", "description": "Absolute path, or relative to the shell's directory."},
     "file_text": {"type": "string", "description": "create: the whole content."},
     "old_str": {"type": "string", "description": "str_replace: the exact text to replace."},
     "new_str": {"type": "string", "description": "str_replace / insert: the new text."},
     "insert_line": {"type": "integer", "description": "insert: the line after which to insert (0 = top)."},
     "view_range": {"type": "array", "items": {"type": "integer"},
                    "description": "view: [first, last] line, 1-based; last -1 means to the end."}},
    ["command", "path"])

SUBMIT = _function(
    "submit", "Finish the task. Put the final answer (a number, an expression, a choice letter, or the full "
              "solution source code) in `answer`; for a repository task, submit with no answer: the "
              "changes in the repository are the submission.",
    {"answer": {"type": "string", "description": "The final answer, if the task asks for one."}},
    [])

ALL = [BASH, EDITOR, SUBMIT]
NAMES = {tool["function"]["name"] for tool in ALL}
