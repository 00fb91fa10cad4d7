"""Projects (tenants) on the API in process: two projects, each route of the API tried by one with
the other's ids and key, in a table that must name every route the app serves (a new route without
its row fails :func:`test_every_route_has_a_row`).

Jobs are stored but never enqueued (``send_chain`` is a no-op here: the session's Redis is the
stack's too, whose workers would run them), and are cancelled at the end. Another project's id must
answer exactly as an unknown id does: 404 and the same body, the id aside."""
from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field

import pytest

pytestmark = pytest.mark.unit
ADMIN = {"Authorization": f"Bearer {os.environ['PRORL_API_TOKEN']}"}
SHELL = {"data_source": "shell", "commands": ["true"]}


@dataclass
class World:
    """Project a's things, and the keys of a, b and the operator."""

    a: dict
    b: dict
    a_name: str
    b_name: str
    a_job: str
    a_group: str
    a_ended: str  # a job of a's that ended (cancelled): it is in the completion stream
    cursor: str  # before a_ended
    a_backend: str  # private to a
    shared: str  # the operator's
    jobs: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def app(redis_url):
    from flask_api import create_app

    return create_app({"TESTING": True})


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture(scope="module")
def world(app, redis_url):
    import tasks.chain
    from prorl_celery.llm.registry import BackendRegistry
    from prorl_celery.projects import ProjectStore

    from config.settings import get_settings

    mp = pytest.MonkeyPatch()
    mp.setattr(tasks.chain, "send_chain", lambda *a, **k: None)  # stored, never run
    mp.setattr(get_settings(), "project_backend_networks", "10.0.0.0/8")
    store = app.extensions["prorl_store"]
    tag = uuid.uuid4().hex[:8]
    projects = ProjectStore(store.redis)
    a_name, b_name = f"a-{tag}", f"b-{tag}"
    a = {"Authorization": f"Bearer {projects.add(a_name).key}"}
    b = {"Authorization": f"Bearer {projects.add(b_name).key}"}
    client = app.test_client()
    a_job = _submit(client, a, f"aj-{tag}")
    group = client.post("/groups", json={"instance": SHELL, "n": 2, "group_id": f"ag-{tag}"}, headers=a)
    assert group.status_code == 202, group.get_data(as_text=True)
    cursor = client.get("/completions", query_string={"cursor": "latest"}, headers=ADMIN).get_json()["cursor"]
    a_ended = _submit(client, a, f"ae-{tag}")
    assert client.delete(f"/jobs/{a_ended}", headers=a).status_code == 200
    port = int(tag[:4], 16) % 60000 + 1
    a_backend = _backend(client, a, f"http://10.97.0.1:{port}")
    shared = _backend(client, ADMIN, f"http://10.78.0.1:{port}")
    w = World(a, b, a_name, b_name, a_job, f"ag-{tag}", a_ended, cursor, a_backend, shared,
              [a_job, a_ended, *group.get_json()["job_ids"]])
    yield w
    from tasks.chain import cancel_many

    cancel_many(store, [r for r in store.get_many(w.jobs) if r is not None], reason="test over")
    registry = BackendRegistry(store.redis)
    registry.clear([bid for bid in registry.ids() if bid in (w.a_backend, w.shared)
                    or (registry.get(bid).project or "") in (a_name, b_name)])
    for name in (a_name, b_name):
        projects.revoke(name)
    mp.undo()


def _submit(client, headers, job_id: str | None = None) -> str:
    body = {"instance": SHELL, **({"job_id": job_id} if job_id else {})}
    resp = client.post("/jobs", json=body, headers=headers)
    assert resp.status_code == 202, resp.get_data(as_text=True)
    return resp.get_json()["job_ids"][0]


def _backend(client, headers, address: str) -> str:
    resp = client.post("/llm_servers", json={"address": address, "probe": False}, headers=headers)
    assert resp.status_code in (200, 201), resp.get_data(as_text=True)
    return resp.get_json()["id"]


def as_unknown(client, method: str, path: str, real: str, headers: dict, **kwargs) -> None:
    """``path`` with another project's id ``real`` answers as it does with an id never used."""
    fake = f"{real[:-4]}zzzz" if len(real) > 8 else real + "zzzz"
    got = client.open(path.replace("{}", real), method=method, headers=headers, **kwargs)
    unknown = client.open(path.replace("{}", fake), method=method, headers=headers, **kwargs)
    assert got.status_code == unknown.status_code == 404, (path, got.get_data(as_text=True))
    assert got.get_json() == json.loads(unknown.get_data(as_text=True).replace(fake, real)), path


def _status(client, job_id: str) -> str:
    return client.get(f"/jobs/{job_id}", headers=ADMIN).get_json()["status"]


# -- one row per route: what project b may not do with project a's things -------------------------
def jobs_submit(c, w: World):
    resp = c.post("/jobs", json={"instance": SHELL, "job_id": w.a_job}, headers=w.b)  # a's very request
    assert resp.status_code == 409 and resp.get_json()["error"]["type"] == "job_id_conflict"
    own = _submit(c, w.b)
    w.jobs.append(own)
    assert c.get(f"/jobs/{own}", headers=ADMIN).get_json()["project"] == w.b_name
    assert c.post("/jobs", json={"instance": SHELL, "job_id": w.a_job}, headers=w.a).status_code == 202  # a's retry


def jobs_get(c, w):
    as_unknown(c, "GET", "/jobs/{}", w.a_job, w.b)
    assert c.get(f"/jobs/{w.a_job}", headers=w.a).get_json()["project"] == w.a_name


def jobs_wait(c, w):
    as_unknown(c, "GET", "/jobs/{}/wait", w.a_job, w.b, query_string={"timeout": 0})
    assert c.get(f"/jobs/{w.a_job}/wait", query_string={"timeout": 0}, headers=w.a).status_code == 202


def jobs_cancel(c, w):
    as_unknown(c, "DELETE", "/jobs/{}", w.a_job, w.b)
    assert _status(c, w.a_job) == "queued"


def jobs_ack(c, w):
    from prorl_celery.staleness import WeightVersions

    versions = WeightVersions(c.application.extensions["prorl_store"].redis, w.a_name)
    assert versions.admit(w.a_job, 100)
    assert c.post("/jobs/ack", json={"job_ids": [w.a_job]}, headers=w.b).get_json()["acked"] == 0
    assert versions.unconsumed() == 1
    assert c.post("/jobs/ack", json={"job_ids": [w.a_job]}, headers=w.a).get_json()["acked"] == 1


def weights(c, w):
    resp = c.post("/llm_servers/resume", json={"ids": [w.a_backend], "weight_version": "a-step-3"}, headers=w.a)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert c.get("/weights", headers=w.a).get_json()["current"] >= 1
    assert c.get("/weights", headers=w.b).get_json()["current"] == 0  # b's versions are its own


def healthz(c, w):
    assert c.get("/healthz").status_code in (200, 503)  # open to probes, says nothing of jobs


def groups_submit(c, w):
    resp = c.post("/groups", json={"instance": SHELL, "n": 2, "group_id": w.a_group}, headers=w.b)
    assert resp.status_code == 409


def groups_get(c, w):
    as_unknown(c, "GET", "/groups/{}", w.a_group, w.b)
    assert c.get(f"/groups/{w.a_group}", headers=w.a).get_json()["n"] == 2


def groups_cancel(c, w):
    as_unknown(c, "DELETE", "/groups/{}", w.a_group, w.b)
    assert c.get(f"/groups/{w.a_group}", headers=w.a).get_json()["counts"] == {"queued": 2}


def cancel_all(c, w):
    own = _submit(c, w.b)
    w.jobs.append(own)
    resp = c.post("/cancel_all", json={}, headers=w.b).get_json()
    assert own in resp["job_ids"] and not set(resp["job_ids"]) & set(w.jobs[:4])
    assert _status(c, w.a_job) == "queued"
    resp = c.post("/cancel_all", json={"group_id": w.a_group}, headers=w.b).get_json()
    assert resp["cancelled"] == 0


def completions(c, w):
    def ids(headers):
        body = c.get("/completions", query_string={"cursor": w.cursor}, headers=headers).get_json()
        return [item["job_id"] for item in body["completions"]], body["cursor"]
    theirs, cursor = ids(w.b)
    assert w.a_ended not in theirs and cursor != w.cursor  # the cursor still moves past a's
    assert w.a_ended in ids(w.a)[0] and w.a_ended in ids(ADMIN)[0]


def events(c, w):
    import flask_api.stream

    flask_api.stream.KEEPALIVE_S = 0.2  # a read with nothing for the caller ends as a keepalive
    try:
        for headers, sees in ((w.b, False), (w.a, True)):
            resp = c.get("/events", query_string={"cursor": w.cursor}, headers=headers, buffered=False)
            chunks, text = iter(resp.response), ""
            while ": keepalive" not in text and "event: completion" not in text:
                chunk = next(chunks)
                text += chunk.decode() if isinstance(chunk, bytes) else chunk
            resp.close()
            assert (w.a_ended in text) is sees, text
    finally:
        flask_api.stream.KEEPALIVE_S = 15.0


def compat_start(c, w):
    assert c.post("/start", headers=w.a).status_code in (200, 400)
    assert c.get("/status", headers=w.a).get_json()["status"] == "running"
    assert c.get("/status", headers=w.b).get_json()["status"] == "stopped"  # a's /start is a's
    resp = c.post("/process", json={"instance": SHELL}, headers=w.b)
    assert resp.status_code == 400 and "/start" in resp.get_json()["error"]["message"]


def compat_stop(c, w):
    from flask_api.compat_store import CompatState

    CompatState(c.application.extensions["prorl_store"].redis, w.a_name).track(w.a_job, "a-label")
    assert c.post("/stop", headers=w.b).get_json()["cancelled"] == 0
    assert _status(c, w.a_job) == "queued"


def compat_status(c, w):
    a, b = (c.get("/status", headers=h).get_json()["counts"] for h in (w.a, w.b))
    assert a["queued"] >= 3 and a["cancelled"] >= 1
    everyone = c.get("/status", headers=ADMIN).get_json()["counts"]
    assert everyone["queued"] >= a["queued"] + b["queued"]


def compat_process(c, w):
    """b's /process runs a job of b's (the wait is cut short here: nothing runs it)."""
    finishes = c.application.extensions["prorl_finishes"]
    assert c.post("/start", headers=w.b).status_code in (200, 400)
    original, finishes.wait = finishes.wait, lambda job_id, timeout: None
    try:
        resp = c.post("/process", json={"instance": SHELL, "job_id": "b-label"}, headers=w.b)
    finally:
        finishes.wait = original
        c.post("/stop", headers=w.b)
    assert resp.status_code == 504, resp.get_data(as_text=True)
    job_id = resp.get_json()["error"]["job_id"]
    w.jobs.append(job_id)
    assert c.get(f"/jobs/{job_id}", headers=w.b).get_json()["project"] == w.b_name
    as_unknown(c, "GET", "/jobs/{}", job_id, w.a)


def compat_cancel(c, w):
    resp = c.post("/cancel", json={"job_id": w.a_job}, headers=w.b)
    assert resp.status_code == 404 and resp.get_json()["error"]["type"] == "not_found"
    resp = c.post("/cancel", json={"job_id": "a-label"}, headers=w.b)  # a's label, tracked in compat_stop
    assert resp.status_code == 404
    assert _status(c, w.a_job) == "queued"


def metrics(c, w):
    assert c.get("/metrics", headers=w.b).status_code == 403
    assert c.get("/metrics", headers=ADMIN).status_code == 200


def audit(c, w):  # the fleet's verdicts name every project's audited tasks: the operator's
    assert c.get("/audit", headers=w.b).status_code == 403
    assert c.get("/audit", headers=ADMIN).status_code == 200


def backends_add(c, w, monkeypatch):
    from config.settings import get_settings

    for address in ("http://127.0.0.1:6379", "http://169.254.169.254:80", "http://localhost:8000",
                    "http://[::1]:8000", "http://11.0.0.1:1"):
        for path in ("/llm_servers", "/add_llm_server"):
            resp = c.post(path, json={"address": address, "probe": False} if path == "/llm_servers"
                          else {"address": address}, headers=w.b)
            assert resp.status_code == 403 and resp.get_json()["error"]["field"] == "address", (address, path)
    assert _backend(c, ADMIN, "http://127.0.0.1:9") == c.post(  # the operator's token is not limited
        "/llm_servers", json={"address": "http://127.0.0.1:9", "probe": False}, headers=ADMIN).get_json()["id"]
    c.delete(f"/llm_servers/{_backend(c, ADMIN, 'http://127.0.0.1:9')}", headers=ADMIN)
    monkeypatch.setattr(get_settings(), "project_backend_networks", "")  # the default: projects register none
    assert c.post("/llm_servers", json={"address": "http://10.0.0.1:1", "probe": False}, headers=w.b).status_code == 403
    monkeypatch.undo()
    address = c.get(f"/llm_servers/{w.a_backend}", headers=w.a).get_json()["address"]
    mine = _backend(c, w.b, address)  # the same address: b's own backend, not a's
    assert mine != w.a_backend
    assert c.get(f"/llm_servers/{w.a_backend}", headers=w.a).get_json()["project"] == w.a_name


def backends_list(c, w):
    ids = {b["id"] for b in c.get("/llm_servers", headers=w.b).get_json()["backends"]}
    assert w.shared in ids and w.a_backend not in ids
    ids = {b["id"] for b in c.get("/llm_servers", headers=w.a).get_json()["backends"]}
    assert {w.shared, w.a_backend} <= ids


def backends_get(c, w):
    as_unknown(c, "GET", "/llm_servers/{}", w.a_backend, w.b)
    assert c.get(f"/llm_servers/{w.shared}", headers=w.b).status_code == 200


def backends_remove(c, w):
    as_unknown(c, "DELETE", "/llm_servers/{}", w.a_backend, w.b)
    assert c.delete(f"/llm_servers/{w.shared}", headers=w.b).status_code == 403
    assert c.get(f"/llm_servers/{w.a_backend}", headers=w.a).status_code == 200


def _controls(c, w, path: str, body: dict):
    resp = c.post(path, json={**body, "ids": [w.a_backend]}, headers=w.b)
    assert resp.status_code == 404 and resp.get_json()["error"]["type"] == "not_found", path
    assert c.post(path, json={**body, "ids": [w.shared]}, headers=w.b).status_code == 403, path
    resp = c.post(path, json=body, headers=w.b)  # no ids: b's own backends only
    assert resp.status_code == 200, resp.get_data(as_text=True)
    touched = set().union(*(resp.get_json().get(k) or [] for k in ("in_flight", "modes", "resumed")))
    assert w.a_backend not in touched and w.shared not in touched, path
    statuses = {b["id"]: b["status"] for b in c.get("/llm_servers", headers=ADMIN).get_json()["backends"]}
    assert statuses[w.a_backend] == statuses[w.shared] == "active", path
    c.post("/llm_servers/resume", json={}, headers=w.b)


def backends_drain(c, w):
    _controls(c, w, "/llm_servers/drain", {"wait": 0})


def backends_pause(c, w):
    _controls(c, w, "/llm_servers/pause", {"mode": "drain", "wait": 0})


def backends_resume(c, w):
    _controls(c, w, "/llm_servers/resume", {})


def compat_add_server(c, w):
    resp = c.post("/add_llm_server", json={"address": "http://10.79.0.1:5"}, headers=w.b)
    assert c.get(f"/llm_servers/{resp.get_json()['id']}", headers=ADMIN).get_json()["project"] == w.b_name
    as_unknown(c, "GET", "/llm_servers/{}", resp.get_json()["id"], w.a)


def compat_clear_servers(c, w):
    removed = c.post("/clear_llm_server", headers=w.b).get_json()["removed"]
    assert removed and w.a_backend not in removed and w.shared not in removed
    ids = {b["id"] for b in c.get("/llm_servers", headers=ADMIN).get_json()["backends"]}
    assert {w.a_backend, w.shared} <= ids and not ids & set(removed)


def openapi(c, w):
    assert c.get("/openapi.json", headers=w.b).status_code == 200  # the same document for everyone


ROUTES = {
    ("POST", "/jobs"): jobs_submit, ("GET", "/jobs/<job_id>"): jobs_get,
    ("GET", "/jobs/<job_id>/wait"): jobs_wait, ("DELETE", "/jobs/<job_id>"): jobs_cancel,
    ("POST", "/jobs/ack"): jobs_ack, ("GET", "/weights"): weights, ("GET", "/healthz"): healthz,
    ("POST", "/groups"): groups_submit, ("GET", "/groups/<group_id>"): groups_get,
    ("DELETE", "/groups/<group_id>"): groups_cancel, ("POST", "/cancel_all"): cancel_all,
    ("GET", "/completions"): completions, ("GET", "/events"): events,
    ("POST", "/start"): compat_start, ("POST", "/stop"): compat_stop, ("GET", "/status"): compat_status,
    ("POST", "/process"): compat_process, ("POST", "/cancel"): compat_cancel, ("GET", "/metrics"): metrics, ("GET", "/audit"): audit,
    ("POST", "/llm_servers"): backends_add, ("GET", "/llm_servers"): backends_list,
    ("GET", "/llm_servers/<backend_id>"): backends_get, ("DELETE", "/llm_servers/<backend_id>"): backends_remove,
    ("POST", "/llm_servers/drain"): backends_drain, ("POST", "/llm_servers/pause"): backends_pause,
    ("POST", "/llm_servers/resume"): backends_resume, ("POST", "/add_llm_server"): compat_add_server,
    ("POST", "/clear_llm_server"): compat_clear_servers, ("GET", "/openapi.json"): openapi,
}


def test_every_route_has_a_row(app):
    served = {(method, rule.rule) for rule in app.url_map.iter_rules() if rule.endpoint != "static"
              for method in rule.methods - {"HEAD", "OPTIONS"}}
    assert served == set(ROUTES), f"routes without a row: {served - set(ROUTES)}; rows without a route: " \
                                  f"{set(ROUTES) - served}"


@pytest.mark.parametrize("route", list(ROUTES), ids=lambda r: f"{r[0]} {r[1]}")
def test_a_project_reaches_only_its_own(client, world, route, monkeypatch):
    check = ROUTES[route]
    check(client, world, monkeypatch) if "monkeypatch" in check.__code__.co_varnames else check(client, world)


def test_a_revoked_key_is_refused_at_once(client, world, app):
    from prorl_celery.projects import ProjectStore

    projects = ProjectStore(app.extensions["prorl_store"].redis)
    issued = projects.add(world.a_name)
    headers = {"Authorization": f"Bearer {issued.key}"}
    assert client.get(f"/jobs/{world.a_job}", headers=headers).status_code == 200
    assert projects.revoke(issued.key_id) == [issued.key_id]
    resp = client.get(f"/jobs/{world.a_job}", headers=headers)
    assert resp.status_code == 401 and "Authorization: Bearer" in resp.get_json()["error"]["message"]
    assert client.get(f"/jobs/{world.a_job}", headers=world.a).status_code == 200  # a's other key lives on
    forged = issued.key[:-3] + ("abc" if not issued.key.endswith("abc") else "abd")
    assert client.get("/weights", headers={"Authorization": f"Bearer {forged}"}).status_code == 401


def test_the_operator_sees_every_project(client, world):
    assert client.get(f"/jobs/{world.a_job}", headers=ADMIN).get_json()["project"] == world.a_name
    assert client.get(f"/groups/{world.a_group}", headers=ADMIN).status_code == 200
    ids = {b["id"] for b in client.get("/llm_servers", headers=ADMIN).get_json()["backends"]}
    assert {world.a_backend, world.shared} <= ids
