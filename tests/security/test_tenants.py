"""Cross-tenant attacks on the running service: project b, holding a key of its own, goes after
project a's jobs over real HTTP (http.client: no hook adds the operator's token). Every attempt
answers as an unknown id would; a's rollout runs on untouched; a revoked key is refused by the next
request; a guessed or spliced key is no key. ``tests/flask_api/test_projects.py`` tries every route."""
from __future__ import annotations

import uuid

import pytest
import redis

from prorl_celery.projects import ProjectStore
from tests.security.test_auth import raw

LOCAL = {"runtime": "local"}


@pytest.fixture
def two(redis_url):
    """Two projects: (name, Authorization header) each; revoked after the test."""
    store = ProjectStore(redis.Redis.from_url(redis_url))
    tag = uuid.uuid4().hex[:8]
    made = [(f"sec-a-{tag}", store.add(f"sec-a-{tag}").key), (f"sec-b-{tag}", store.add(f"sec-b-{tag}").key)]
    yield [(name, {"Authorization": f"Bearer {key}"}) for name, key in made]
    for name, _ in made:
        store.revoke(name)


def _shell(*commands: str) -> dict:
    return {"data_source": "shell", "commands": list(commands), "sandbox": LOCAL}


def test_another_projects_running_job_is_out_of_reach(stack, api, two):
    (a_name, a), (_, b) = two
    status, body = raw(api, "POST", "/jobs", a, {"instance": _shell("sleep 30")})
    assert status == 202, body
    job = body["job_ids"][0]
    _, cursor = raw(api, "GET", "/completions?cursor=latest", a)
    unknown = f"{job[:-4]}zzzz"
    for method, path, body in (("GET", "/jobs/{}", None), ("GET", "/jobs/{}/wait?timeout=1", None),
                               ("DELETE", "/jobs/{}", None), ("POST", "/cancel", {"job_id": "{}"})):
        got = raw(api, method, path.replace("{}", job), b, body and {"job_id": job})
        never = raw(api, method, path.replace("{}", unknown), b, body and {"job_id": unknown})
        assert got[0] == never[0] == 404, (path, got)
        assert str(got[1]).replace(job, "ID") == str(never[1]).replace(unknown, "ID"), (path, got, never)
    assert raw(api, "POST", "/cancel_all", b, {})[1]["job_ids"] == []
    assert raw(api, "POST", "/jobs", b, {"instance": _shell("sleep 30"), "job_id": job})[0] == 409
    status, seen = raw(api, "GET", f"/jobs/{job}", a)
    assert status == 200 and seen["status"] not in ("cancelled", "failed") and seen["project"] == a_name
    assert raw(api, "POST", "/cancel_all", a, {})[1]["job_ids"] == [job]  # a's own, and only a's
    theirs = raw(api, "GET", f"/completions?cursor={cursor['cursor']}&wait=0", b)[1]["completions"]
    mine = raw(api, "GET", f"/completions?cursor={cursor['cursor']}&wait=2", a)[1]["completions"]
    assert job not in [c["job_id"] for c in theirs] and job in [c["job_id"] for c in mine]


def test_a_revoked_key_is_refused_by_the_next_request(stack, api, redis_url, two):
    (a_name, a), _ = two
    store = ProjectStore(redis.Redis.from_url(redis_url))
    assert raw(api, "GET", "/weights", a)[0] == 200
    store.revoke(a_name)
    status, body = raw(api, "GET", "/weights", a)
    assert status == 401 and body["error"]["type"] == "unauthorized" and "Authorization" in body["error"]["message"]
    assert raw(api, "GET", "/weights", {"Authorization": f"Bearer {stack.api_token}"})[0] == 200


def test_a_spliced_or_guessed_key_is_no_key(stack, api, two):
    """The id of one key with the secret of another, a key with a character changed, the
    operator's token inside a key's shape: all 401."""
    (_, a), (_, b) = two
    a_key, b_key = a["Authorization"].split()[1], b["Authorization"].split()[1]
    a_id, a_secret = a_key.split("_")[1], a_key.split("_", 2)[2]
    b_id, b_secret = b_key.split("_")[1], b_key.split("_", 2)[2]
    flipped = a_key[:-1] + ("x" if a_key[-1] != "x" else "y")
    for forged in (f"prorl_{a_id}_{b_secret}", f"prorl_{b_id}_{a_secret}", flipped,
                   f"prorl_{a_id}_{stack.api_token}", f"prorl_{'0' * 16}_{a_secret}", a_key + " "):
        if forged.strip() == a_key:
            continue
        status, body = raw(api, "GET", "/llm_servers", {"Authorization": f"Bearer {forged}"})
        assert status == 401 and body["error"]["type"] == "unauthorized", forged


def test_a_project_cannot_point_the_service_at_its_own_host(stack, api, two):
    """A project's backend is probed by the API and called by the workers: by default a project
    registers none (PRORL_PROJECT_BACKEND_NETWORKS empty), so neither Redis on loopback nor a
    metadata endpoint can be made a target; the operator's token still registers anything."""
    _, (_, b) = two
    for address in ("http://127.0.0.1:6379", "http://169.254.169.254", "http://localhost:8000/v1"):
        for path, body in (("/llm_servers", {"address": address}), ("/add_llm_server", {"address": address})):
            status, reply = raw(api, "POST", path, b, body)
            assert status == 403 and reply["error"]["field"] == "address", (path, address, reply)
    status, listed = raw(api, "GET", "/llm_servers", b)
    assert status == 200 and not [x for x in listed["backends"] if x.get("project")]
