"""The Python client against the running service."""
from __future__ import annotations

import pickle
import uuid

import pytest

from prorl_celery import errors
from prorl_celery.client import ProrlClient, ProrlClientError

LOCAL = {"runtime": "local"}


def shell(*commands: str) -> dict:
    return {"data_source": "shell", "commands": list(commands), "sandbox": LOCAL}


def test_submit_wait_and_idempotent_retry(api):
    client = ProrlClient(api)
    job_id = f"c-{uuid.uuid4().hex[:8]}"
    assert client.submit(shell("echo hi"), job_id=job_id) == job_id
    assert client.submit(shell("echo hi"), job_id=job_id) == job_id  # a retry runs nothing new
    with pytest.raises(errors.JobIdConflict) as taken:  # another request under that id: never the old job
        client.submit(shell("echo other"), job_id=job_id)
    assert taken.value.field == "job_id" and job_id in str(taken.value)
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


def test_errors_are_raised_as_their_registered_class(api):
    """Each answer's type is its class in prorl_celery.errors, and still a ProrlClientError."""
    client = ProrlClient(api, retries=0)
    with pytest.raises(errors.NotFound) as missing:
        client.get("no-such-job")
    assert isinstance(missing.value, ProrlClientError) and isinstance(missing.value, KeyError)
    assert "no-such-job" in str(missing.value) and missing.value.status == 404
    with pytest.raises(errors.InvalidRequest) as bad:
        client.submit({"data_source": "nope"})
    assert type(bad.value).__mro__[1] is errors.InvalidRequest  # exactly invalid_request
    assert bad.value.field == "instance.data_source" and bad.value.status == 400
    refused = {**shell("true"), "sandbox": {"runtime": "bwrap", "image": "/etc"}}
    with pytest.raises(errors.PolicyDenied) as denied:  # an InvalidRequest too
        client.submit(refused)
    assert isinstance(denied.value, errors.InvalidRequest) and denied.value.status == 403
    done = client.submit(shell("true"))
    client.wait(done, timeout=30)
    with pytest.raises(errors.JobAlreadyTerminal) as late:
        client.cancel(done)
    assert late.value.status == 409 and late.value.error["status"] == "completed"
    with pytest.raises(ProrlClientError) as anonymous:  # not the service's own error: no class
        ProrlClient(api, token="wrong", retries=0).get(done)
    assert type(anonymous.value) is ProrlClientError and not isinstance(anonymous.value, errors.ProrlError)
    assert anonymous.value.status == 401 and anonymous.value.error["type"] == "unauthorized"
    again = pickle.loads(pickle.dumps(late.value))  # e.g. from a trainer's worker to its driver
    assert type(again) is type(late.value) and again.error == late.value.error
