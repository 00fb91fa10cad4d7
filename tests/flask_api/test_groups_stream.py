"""Groups, group and bulk cancel, and the completion stream (long poll and SSE), over real HTTP."""
from __future__ import annotations

import json
import uuid

import requests

from tests.conftest import submit, wait, wait_until

LOCAL = {"runtime": "local"}


def shell(*commands: str, **extra) -> dict:
    return {"data_source": "shell", "commands": list(commands), "sandbox": LOCAL, **extra}


def _cursor_now(api: str) -> str:
    """A cursor positioned after everything that finished so far."""
    cursor = "0-0"
    while True:
        body = requests.get(f"{api}/completions", params={"cursor": cursor, "limit": 5000}, timeout=10).json()
        if not body["completions"]:
            return cursor
        cursor = body["cursor"]


def test_group_of_n_samples_with_reward_stats(api):
    gid = f"g-{uuid.uuid4().hex[:8]}"
    instance = {"data_source": "shell", "sandbox": LOCAL, "commands": ["true"]}
    resp = requests.post(f"{api}/groups", json={"instance": instance, "n": 3, "group_id": gid}, timeout=10)
    assert resp.status_code == 202
    assert resp.json()["job_ids"] == [f"{gid}-0", f"{gid}-1", f"{gid}-2"]
    views = [wait(api, job_id) for job_id in resp.json()["job_ids"]]
    assert [v["result"]["trajectory_id"] for v in views] == [0, 1, 2]
    body = requests.get(f"{api}/groups/{gid}", timeout=10).json()
    assert body["complete"] and body["counts"] == {"completed": 3}
    assert body["rewards"] == {"count": 3, "mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0, "all_equal": True}
    again = requests.post(f"{api}/groups", json={"instance": instance, "n": 3, "group_id": gid}, timeout=10)
    assert again.json()["job_ids"] == resp.json()["job_ids"]
    assert requests.get(f"{api}/jobs/{gid}-0", timeout=10).json()["attempts"]["run"] == 1


def test_mixed_rewards_and_unknown_group(api):
    gid = f"mix-{uuid.uuid4().hex[:8]}"
    ids = [submit(api, shell("true" if i % 2 else "false"), group_id=gid, job_id=f"{gid}-{i}") for i in range(4)]
    for job_id in ids:
        wait(api, job_id)
    rewards = requests.get(f"{api}/groups/{gid}", timeout=10).json()["rewards"]
    assert rewards["mean"] == 0.5 and rewards["all_equal"] is False and rewards["min"] == 0.0
    assert requests.get(f"{api}/groups/nope", timeout=10).status_code == 404
    assert requests.delete(f"{api}/groups/nope", timeout=10).status_code == 404
    bad = requests.post(f"{api}/groups", json={"instance": shell("true"), "n": 0}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "n"


def test_cancel_a_group_leaves_other_jobs_alone(api):
    gid = f"cg-{uuid.uuid4().hex[:8]}"
    doomed = [submit(api, shell("sleep 30"), group_id=gid) for _ in range(3)]
    other = submit(api, shell("sleep 1"))
    wait_until(lambda: all(requests.get(f"{api}/jobs/{j}", timeout=5).json()["status"] == "run" for j in doomed),
               30, "the group to run")
    resp = requests.delete(f"{api}/groups/{gid}", timeout=30)
    assert resp.status_code == 200 and sorted(resp.json()["cancelled"]) == sorted(doomed)
    for job_id in doomed:
        result = wait(api, job_id, timeout=10)["result"]
        assert result["status"] == "cancelled" and result["critical_error"] == "cancelled"
    assert wait(api, other)["status"] == "completed"


def test_cancel_all_filtered_by_data_source(api):
    gid = f"ca-{uuid.uuid4().hex[:8]}"
    ids = [submit(api, shell("sleep 30"), group_id=gid) for _ in range(2)]
    resp = requests.post(f"{api}/cancel_all", json={"group_id": gid, "data_source": "shell"}, timeout=30)
    assert resp.status_code == 200 and sorted(resp.json()["job_ids"]) == sorted(ids)
    assert all(wait(api, j, timeout=10)["status"] == "cancelled" for j in ids)
    none = requests.post(f"{api}/cancel_all", json={"data_source": "no-such"}, timeout=10).json()
    assert none["cancelled"] == 0
    bad = requests.post(f"{api}/cancel_all", json={"group": "x"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "group"


def test_completions_long_poll_resumes_without_gaps_or_duplicates(api):
    cursor = _cursor_now(api)
    gid = f"cp-{uuid.uuid4().hex[:8]}"
    ids = [submit(api, shell(f"sleep 0.{i}"), group_id=gid) for i in range(5)]
    seen: list[str] = []
    while len(seen) < 5:
        body = requests.get(f"{api}/completions", params={"cursor": cursor, "wait": 10, "limit": 2,
                                                          "group_id": gid}, timeout=20).json()
        assert body["completions"], "long poll returned nothing within 10 s"
        seen += [c["job_id"] for c in body["completions"]]
        assert all(c["job"]["status"] == "completed" for c in body["completions"])
        cursor = body["cursor"]  # a reconnect with the last cursor continues exactly there
    assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen))
    empty = requests.get(f"{api}/completions", params={"cursor": cursor, "wait": 0.2, "group_id": gid}, timeout=10)
    assert empty.json() == {"cursor": cursor, "completions": []}
    bad = requests.get(f"{api}/completions", params={"cursor": "abc"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "cursor"


def test_events_stream_as_sse_and_resume_from_last_event_id(api):
    gid = f"ev-{uuid.uuid4().hex[:8]}"
    ids = [submit(api, shell("true"), group_id=gid) for _ in range(3)]
    for job_id in ids:
        wait(api, job_id)

    def read_events(headers: dict, n: int) -> list[tuple[str, dict]]:
        out = []
        with requests.get(f"{api}/events", params={"group_id": gid}, headers=headers, stream=True,
                          timeout=20) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            event_id = None
            for line in resp.iter_lines(decode_unicode=True):
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("data: "):
                    out.append((event_id, json.loads(line[6:])))
                    if len(out) == n:
                        return out
        return out

    first = read_events({}, 3)
    assert sorted(data["job_id"] for _, data in first) == sorted(ids)
    resumed = read_events({"Last-Event-ID": first[0][0]}, 2)
    assert [data["job_id"] for _, data in resumed] == [data["job_id"] for _, data in first[1:]]


def test_long_poll_longer_than_the_redis_socket_timeout(api):
    """redis-py reads with a 5 s socket timeout by default; a 6 s long poll must still answer."""
    gid = f"lp-{uuid.uuid4().hex[:8]}"
    resp = requests.get(f"{api}/completions", params={"cursor": "0-0", "wait": 6, "group_id": gid}, timeout=30)
    assert resp.status_code == 200 and resp.json() == {"cursor": "0-0", "completions": []}
