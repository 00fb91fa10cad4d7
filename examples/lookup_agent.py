"""A black-box harness of a few dozen lines for the ``lookup`` task (tasks/handlers/lookup.py):
an ordinary OpenAI client, two model calls and one tool of its own.

1. The model is shown the task and asked which file to open.
2. The harness opens the first of the folder's files the answer names (its own tool: the model
   never sees how) and shows the model what the file says.
3. The model is asked for the code; its answer is the harness's final message, which the domain
   grades. Opening the wrong file shows another file's code: the reward depends on the
   observation.

It runs as a ``command`` harness behind the session's gateway (``OPENAI_BASE_URL``,
``OPENAI_API_KEY``, ``PRORL_MODEL``, the task in ``PRORL_TASK_FILE``), from the venv
``bash scripts/install-harnesses.sh openai-client`` makes, which also copies this file there:

    {"harness": "command", "max_calls": 2, "wall_s": 120,
     "command": "/opt/prorl-harnesses/openai-client/bin/python /opt/prorl-harnesses/openai-client/lookup_agent.py"}

The gateway records both calls: the second prompt extends the first one id for id, so the
trajectory is one sequence whose observation tokens have loss mask 0.
"""
import os
import re
import sys

import openai


def main() -> None:
    client, model = openai.OpenAI(), os.environ["PRORL_MODEL"]
    task = open(os.environ["PRORL_TASK_FILE"]).read()
    files = sorted(name for name in os.listdir(".") if os.path.isfile(name) and not name.startswith("."))
    messages = [{"role": "user", "content": f"{task}\nWhich file do you open? Answer with its name."}]
    first = client.chat.completions.create(model=model, messages=messages).choices[0].message.content or ""
    named = [name for name in files if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", first)]
    if named:
        seen = f"{named[0]} says:\n{open(named[0]).read().strip()}"
    else:
        seen = f"No such file. The files are: {', '.join(files)}."
    messages += [{"role": "assistant", "content": first},
                 {"role": "user", "content": f"{seen}\nWhat is the code? Answer with the code only."}]
    second = client.chat.completions.create(model=model, messages=messages).choices[0].message.content or ""
    print(second)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
