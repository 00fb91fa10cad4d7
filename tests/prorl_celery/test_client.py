"""The Python client against the running service."""
from __future__ import annotations

import uuid

import pytest

from prorl_celery.client import ProrlClient, ProrlClientError

LOCAL = {"runtime": "local"}


def shell(*commands: str) -> dict:
    return {"data_source": "shell", "commands": list(commands), "sandbox": LOCAL}


def test_submit_wait_and_idempotent_retry(api):
    client = ProrlClient(api)
    job_id = f"c-{uuid.uuid4().hex[:8]}"
    assert client.submit(shell("echo hi"), job_id=job_id) == job_id
    assert client.submit(shell("echo other"), job_id=job_id) == job_id  # a retry runs nothing new
    view = client.wait(job_id, timeout=30)
    assert view["result"]["steps"][0]["output"] == "hi\n"


def test_as_completed_yields_each_job_once_in_completion_order(api):
    client = ProrlClient(api)
    fast = client.submit(shell("true"))
    client.wait(fast, timeout=30)  # finished before as_completed starts: still yielded
    slow = client.submit(shell("sleep 1.5"))
    mid = client.submit(shell("sleep 0.5"))
    order = [view["job_id"] for view in client.as_completed([slow, mid, fast], timeout=30)]
    assert order == [fast, mid, slow]


def test_group_as_completed_and_cancel(api):
    client = ProrlClient(api)
    gid, ids = client.submit_group(shell("true"), n=4)
    views = list(client.as_completed(group_id=gid, timeout=30))
    assert sorted(v["job_id"] for v in views) == sorted(ids)
    assert client.group(gid)["rewards"]["mean"] == 1.0
    gid2, ids2 = client.submit_group(shell("sleep 30"), n=2)
    assert sorted(client.cancel_group(gid2)) == sorted(ids2)
    assert {v["status"] for v in client.as_completed(ids2, timeout=10)} == {"cancelled"}


def test_errors_are_typed_and_not_retried(api):
    client = ProrlClient(api, retries=3)
    with pytest.raises(ProrlClientError) as info:
        client.get("no-such-job")
    assert info.value.status == 404 and info.value.error["type"] == "not_found"
    with pytest.raises(ProrlClientError) as info:
        client.submit({"data_source": "nope"})
    assert info.value.status == 400 and info.value.error["field"] == "instance.data_source"
