"""``prorl-celery projects add|list|revoke`` in process, on the session's Redis."""
from __future__ import annotations

import json
import uuid

import pytest

from prorl_celery.ops.cli import main

pytestmark = pytest.mark.unit


def test_add_prints_the_key_once_list_shows_ids_revoke_refuses(redis_url, capsys):
    from prorl_celery.connections import get_redis
    from prorl_celery.projects import ProjectStore

    name = f"cli-{uuid.uuid4().hex[:8]}"
    assert main(["projects", "add", name, "--weight", "2"]) == 0
    key = capsys.readouterr().out.strip()
    store = ProjectStore(get_redis())
    assert store.authenticate(key.encode()) == name
    assert main(["projects", "list", "--json"]) == 0
    listed = next(p for p in json.loads(capsys.readouterr().out) if p["name"] == name)
    assert listed["weight"] == 2 and len(listed["keys"]) == 1 and key not in json.dumps(listed)
    assert listed["keys"][0] in key
    assert main(["projects", "revoke", name]) == 0 and "revoked 1 key" in capsys.readouterr().out
    assert store.authenticate(key.encode()) is None
    assert main(["projects", "revoke", f"none-{name}"]) == 1
    assert main(["projects", "add", "Bad Name"]) == 2


def test_sync_makes_a_tenant_files_projects_and_keeps_their_keys(redis_url, tmp_path, capsys):
    import stat

    from prorl_celery.connections import get_redis
    from prorl_celery.projects import ProjectStore

    tag = uuid.uuid4().hex[:8]
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[projects.train-{tag}]\nweight = 3\n\n[projects.eval-{tag}]\n')
    keys_dir = tmp_path / "keys"
    assert main(["projects", "sync", str(tenants), "--keys-dir", str(keys_dir)]) == 0
    store = ProjectStore(get_redis())
    written = {p.stem: p for p in keys_dir.iterdir()}
    assert set(written) == {f"train-{tag}", f"eval-{tag}"}
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    for name, path in written.items():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert store.authenticate(path.read_text().strip().encode()) == name
    tenants.write_text(f'[projects.train-{tag}]\nweight = 5\nmax_in_flight = 40\nover = {{max_in_flight = "429"}}\n'
                       f'\n[projects.eval-{tag}]\n')
    before = {p: p.read_text() for p in written.values()}
    assert main(["projects", "sync", str(tenants), "--keys-dir", str(keys_dir)]) == 0  # a restart of the head
    assert {p: p.read_text() for p in written.values()} == before  # the keys handed out stay valid
    train = next(p for p in store.list() if p.name == f"train-{tag}")
    assert train.weight == 5 and train.quotas.max_in_flight == 40 and train.quotas.over == {"max_in_flight": "429"}
    store.revoke(f"eval-{tag}")  # a revoke outlives the next start of the head
    assert main(["projects", "sync", str(tenants), "--keys-dir", str(keys_dir)]) == 0
    assert store.authenticate(written[f"eval-{tag}"].read_text().strip().encode()) is None
    assert next(p for p in store.list() if p.name == f"eval-{tag}").keys == []
    assert "new key" in capsys.readouterr().out
    tenants.write_text('[projects."Bad Name"]\n')
    assert main(["projects", "sync", str(tenants), "--keys-dir", str(keys_dir)]) == 2


def test_set_changes_weight_and_quotas_and_list_shows_them(redis_url, capsys):
    name = f"cli-{uuid.uuid4().hex[:8]}"
    assert main(["projects", "add", name]) == 0
    capsys.readouterr()
    assert main(["projects", "set", name, "--weight", "4", "--max-in-flight", "10", "--tokens-per-hour", "500",
                 "--over", "tokens_per_hour=429"]) == 0
    assert json.loads(capsys.readouterr().out) == {"max_in_flight": 10, "tokens_per_hour": 500,
                                                   "over": {"tokens_per_hour": "429"}}
    assert main(["projects", "set", name, "--max-in-flight", "-1", "--over", "hold"]) == 0
    capsys.readouterr()
    assert main(["projects", "list", "--json"]) == 0
    listed = next(p for p in json.loads(capsys.readouterr().out) if p["name"] == name)
    assert listed["weight"] == 4 and listed["quotas"]["max_in_flight"] is None
    assert listed["quotas"]["tokens_per_hour"] == 500 and set(listed["quotas"]["over"].values()) == {"hold"}
    assert main(["projects", "list"]) == 0 and "tokens_per_hour=500 (hold)" in capsys.readouterr().out
    assert main(["projects", "set", name, "--over", "nope=429"]) == 2
    assert main(["projects", "set", f"none-{name}", "--max-sandboxes", "1"]) == 2


def test_list_and_status_show_what_each_project_holds(redis_url, capsys):
    """Its rollouts in a stage, the sandboxes they may hold (the transition script's sum of their
    needs, written here as it would be for one Harbor job with two services), its pending jobs."""
    from prorl_celery import keys
    from prorl_celery.connections import get_redis
    from prorl_celery.fairshare import FairShare

    name = f"cli-{uuid.uuid4().hex[:8]}"
    assert main(["projects", "add", name]) == 0
    client = get_redis()
    client.hset(keys.job_counts_of(name), "init|harbor", 1)
    client.set(keys.project_sandboxes(name), 4)
    FairShare(client).enqueue(name, [(f"{name}-pending", 0, 1)])
    capsys.readouterr()
    try:
        assert main(["projects", "list", "--json"]) == 0
        listed = next(p for p in json.loads(capsys.readouterr().out) if p["name"] == name)
        assert listed["now"] == {"in_stages": 1, "sandboxes": 4, "pending": 1}
        assert main(["projects", "list"]) == 0
        assert "now: 1 rollouts in a stage holding up to 4 sandboxes, 1 pending" in capsys.readouterr().out
        assert main(["status", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["held"][name] == listed["now"]
    finally:
        FairShare(client).forget([(name, f"{name}-pending")])
        client.delete(keys.job_counts_of(name), keys.project_sandboxes(name))
        main(["projects", "revoke", name])
