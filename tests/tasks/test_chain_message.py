"""The chain message a submission sends is the one ``chain.apply_async`` would send."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest
import redis

from tests.conftest import ROOT

IGNORED_HEADERS = {"id", "root_id", "parent_id", "origin", "argsrepr", "kwargsrepr", "stamped_headers", "stamps"}
# Sends, for each "ours|chain <stage>" line on stdin, that chain and answers "sent": one process for
# every send (each interpreter that imports the Celery app and the tasks costs seconds).
SEND = """
import sys
from prorl_celery.status import JobStatus
from tasks.chain import send_chain, stage_chain
for line in sys.stdin:
    how, start = line.split()
    if how == "ours":
        send_chain("job-1", "shell", start=JobStatus(start))
    else:
        stage_chain("job-1", "shell", start=JobStatus(start)).apply_async()
    print("sent", flush=True)
"""


@pytest.fixture
def sent(redis_url):
    """``sent(how, start)``: the message that chain sends, from a process whose broker is a Redis
    database no worker reads."""
    url = redis_url.rsplit("/", 1)[0] + "/9"
    client = redis.Redis.from_url(url)
    client.flushdb()
    env = {**os.environ, "PRORL_REDIS_URL": url}
    sender = subprocess.Popen([sys.executable, "-c", SEND], cwd=ROOT, env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(how: str, start: str) -> tuple[dict, list]:
        sender.stdin.write(f"{how} {start}\n")
        sender.stdin.flush()
        assert sender.stdout.readline() == "sent\n", f"the sender exited ({sender.poll()})"
        raw = json.loads(client.rpop(start))
        assert client.llen(start) == 0
        body = json.loads(base64.b64decode(raw["body"]))
        headers = {k: v for k, v in raw["headers"].items() if k not in IGNORED_HEADERS}
        for link in body[2]["chain"] or []:
            link["options"].pop("reply_to", None)  # the sender's id, read only by the rpc:// backend
        return headers, body
    yield send
    sender.stdin.close()
    assert sender.wait(60) == 0


def test_send_chain_matches_chain_apply_async(sent):
    stages = ["init", "run", "eval"]
    for start in stages:
        ours = sent("ours", start)
        assert ours == sent("chain", start)
        headers, (args, kwargs, embed) = ours
        assert headers["task"] == f"prorl.{start}" and args == ["job-1"]
        assert kwargs == {"data_source": "shell"}
        later = stages[stages.index(start) + 1:]
        assert [link["options"]["task_id"] for link in reversed(embed["chain"] or [])] == \
            [f"job-1:{stage}" for stage in later]
        assert not headers["ignore_result"]  # every stage's worker and result stay in the backend
