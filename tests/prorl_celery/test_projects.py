"""Projects and their keys in Redis: only a salted digest is kept, a key authenticates as its
project until revoked (by its id, the key itself, or the project's name)."""
from __future__ import annotations

import uuid

import pytest
import redis

from prorl_celery import keys
from prorl_celery.errors import InvalidRequest, UnknownProject
from prorl_celery.projects import ProjectStore

pytestmark = pytest.mark.unit


@pytest.fixture
def projects(redis_url):
    return ProjectStore(redis.Redis.from_url(redis_url))


def test_a_key_is_stored_only_as_a_salted_digest(projects):
    name = f"p-{uuid.uuid4().hex[:8]}"
    first, second = projects.add(name, weight=3), projects.add(name)
    secret = first.key.rsplit("_", 1)[1]
    stored = projects.redis.hget(keys.project_keys(), first.key_id)
    assert secret.encode() not in stored and first.key.encode() not in stored
    assert projects.authenticate(first.key.encode()) == projects.authenticate(second.key.encode()) == name
    listed = next(p for p in projects.list() if p.name == name)
    assert listed.weight == 3 and sorted(listed.keys) == sorted([first.key_id, second.key_id])
    for wrong in (first.key[:-1] + ("A" if first.key[-1] != "A" else "B"), f"prorl_{second.key_id}_{secret}",
                  first.key + "x", "", "prorl__", "\xe9".encode("utf-8").decode()):
        assert projects.authenticate(wrong.encode()) is None, wrong
    assert projects.revoke(first.key) == [first.key_id]  # the key itself names its id
    assert projects.authenticate(first.key.encode()) is None and projects.authenticate(second.key.encode()) == name
    assert projects.revoke(name) == [second.key_id]
    assert projects.authenticate(second.key.encode()) is None
    assert next(p for p in projects.list() if p.name == name).keys == []  # the project stays, keyless


def test_names_and_weights_are_checked(projects):
    for name in ("", "Upper", "a b", "a:b", "x" * 64):
        with pytest.raises(InvalidRequest):
            projects.add(name)
    with pytest.raises(InvalidRequest):
        projects.add("ok-name", weight=0)
    with pytest.raises(UnknownProject):
        projects.revoke(f"nope-{uuid.uuid4().hex[:6]}")
