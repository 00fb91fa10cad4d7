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
