"""The chain message a submission sends is the one ``chain.apply_async`` would send."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import redis

from tests.conftest import ROOT

IGNORED_HEADERS = {"id", "root_id", "parent_id", "origin", "argsrepr", "kwargsrepr", "stamped_headers", "stamps"}
SEND = """
import sys
from prorl_celery.status import JobStatus
from tasks.chain import send_chain, stage_chain
start = JobStatus(sys.argv[2])
if sys.argv[1] == "ours":
    send_chain("job-1", "shell", start=start)
else:
    stage_chain("job-1", "shell", start=start).apply_async()
"""


def _sent(redis_url: str, how: str, start: str) -> tuple[dict, list]:
    """Send from a process whose broker is a Redis database no worker reads; take the message."""
    url = redis_url.rsplit("/", 1)[0] + "/9"
    client = redis.Redis.from_url(url)
    client.flushdb()
    env = {**os.environ, "PRORL_REDIS_URL": url}
    subprocess.run([sys.executable, "-c", SEND, how, start], cwd=ROOT, env=env, check=True, timeout=60)
    raw = json.loads(client.rpop(start))
    body = json.loads(base64.b64decode(raw["body"]))
    headers = {k: v for k, v in raw["headers"].items() if k not in IGNORED_HEADERS}
    for link in body[2]["chain"] or []:
        link["options"].pop("reply_to", None)  # the sender's id, read only by the rpc:// backend
    return headers, body


def test_send_chain_matches_chain_apply_async(redis_url):
    stages = ["init", "run", "eval"]
    for start in stages:
        ours = _sent(redis_url, "ours", start)
        assert ours == _sent(redis_url, "chain", start)
        headers, (args, kwargs, embed) = ours
        assert headers["task"] == f"prorl.{start}" and args == ["job-1"]
        assert kwargs == {"data_source": "shell"}
        later = stages[stages.index(start) + 1:]
        assert [link["options"]["task_id"] for link in reversed(embed["chain"] or [])] == \
            [f"job-1:{stage}" for stage in later]
        assert not headers["ignore_result"]  # every stage's worker and result stay in the backend
