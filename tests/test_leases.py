"""Stage leases against the session's Redis: kept alive while held, renewed only when due."""
from __future__ import annotations

import time
import uuid

from prorl_celery.leases import Lease


def _lease(redis_client, ttl_s: float) -> Lease:
    return Lease(redis_client, f"test:lease:{uuid.uuid4().hex}", ttl_s, owner="test")


def test_a_held_lease_outlives_its_expiry_and_a_released_one_is_gone(redis_client):
    lease = _lease(redis_client, 0.3)
    assert lease.acquire()
    assert not Lease(redis_client, lease.key, 0.3, owner="other").acquire()  # taken
    time.sleep(1.2)  # four expiries: only renewals keep it
    assert redis_client.get(lease.key) == lease.token.encode()
    lease.release()
    assert redis_client.exists(lease.key) == 0


def test_taking_a_lease_does_not_renew_the_others(redis_client):
    first = _lease(redis_client, 3.0)
    assert first.acquire()
    time.sleep(0.5)
    second = _lease(redis_client, 3.0)
    assert second.acquire()
    time.sleep(0.1)  # time for a keeper that renews everything on each new lease to do so
    try:
        assert redis_client.pttl(first.key) < 2600  # still counting down from its own start
    finally:
        first.release()
        second.release()
