"""A store shard killed mid-batch across nodes (issue 37): the head runs two store shards as
``PRORL_STORE_SHARDS_N=2 head.sbatch`` starts them, on the head's namespace; node1 (the README's
commands, given the shards' URLs) and node2 (worker_node.sh, which reads them from the address
file) run the stages against them from their own namespaces. A batch of rollouts of many saved
turns (tests/handlers_for_shards.py) is submitted over HTTP, shard 1's redis-server is SIGKILLed
while some of its rollouts are mid-turns, and head.sbatch starts it again on its data. Every job
ends with a typed result, once; every completed rollout holds its turns once each, in order, on
its shard; the stages the kill cut were resumed.

Run with ``bash scripts/test.sh -m multinode tests/multinode/test_netns_shards.py`` (root).
Size by environment: ``PRORL_MN_SHARD_JOBS`` (32), ``PRORL_MN_SHARD_TURNS`` (12).
"""
from __future__ import annotations

import os
import signal
import time
import urllib.parse
from collections import Counter

import pytest
import redis

from prorl_celery import keys
from prorl_celery.shards import Shards
from tests.multinode import netns
from tests.multinode.cluster import Cluster, poll, running
from tests.shard_checks import check_completions, check_views, cut_stages, instance, mid_turns

JOBS = int(os.environ.get("PRORL_MN_SHARD_JOBS", "32"))
TURNS = int(os.environ.get("PRORL_MN_SHARD_TURNS", "12"))
pytestmark = [pytest.mark.multinode, pytest.mark.timeout(900),
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running(tmp_path_factory.mktemp("multinode-shards"), PRORL_STORE_SHARDS_N="2") as built:
        yield built


def _shards(cluster: Cluster) -> Shards:
    """The head's Redis and its shards, as the workers see them (use inside ``node.call``)."""
    return Shards(cluster.redis(), [redis.Redis.from_url(u) for u in cluster.shard_urls])


def test_the_shards_are_published_on_the_head_and_reached_from_every_node(cluster):
    urls = [urllib.parse.urlsplit(u) for u in cluster.shard_urls]
    password = urllib.parse.urlsplit(cluster.redis_url).password
    assert len(urls) == 2 and len({u.port for u in urls}) == 2, cluster.shard_urls
    for at in urls:
        assert at.hostname == cluster.head.address and at.password == password
        for node in (cluster.node1, cluster.node2, cluster.client):
            assert node.call(redis.Redis(host=at.hostname, port=at.port, password=password).ping), node.name
            bare = redis.Redis(host=at.hostname, port=at.port, socket_timeout=5)
            with pytest.raises(redis.AuthenticationError):  # bound to every interface, never open
                node.call(bare.ping)
    assert cluster.http("GET", "/healthz").json()["store_shards"] == ["ok", "ok"]


def test_a_shard_killed_mid_batch_loses_and_duplicates_nothing(cluster):
    shards, client = _shards(cluster), cluster.client
    ids = cluster.submit([instance(TURNS)] * JOBS)
    on_first = [j for j in ids if shards.index(j) == 0]
    assert on_first and len(on_first) < JOBS  # both shards serve the batch
    poll(lambda: client.call(mid_turns, shards.stores[0], on_first, TURNS) >= 2, 180,
         "rollouts mid-turns on shard 1", cluster.diagnose)

    before = cluster.head_pids()
    os.kill(before["redis-shard-1"], signal.SIGKILL)
    killed_at = time.monotonic()
    poll(lambda: cluster.head_pids()["redis-shard-1"] != before["redis-shard-1"]
         and client.call(shards.stores[0].ping), 150, "head.sbatch to start shard 1 again", cluster.diagnose)
    back_s = time.monotonic() - killed_at

    views = cluster.wait_all(ids, 420)
    ended_s = time.monotonic() - killed_at
    assert len(views) == len(ids), f"{len(ids) - len(views)} jobs never ended\n{cluster.diagnose()}"
    statuses = check_views(views, TURNS)  # typed results; each complete one's turns once, in order
    check_completions(client.call(shards.head.xrange, keys.completions()), ids)  # none lost, none twice
    assert statuses == {"completed": JOBS}, statuses

    def stored() -> tuple[list[int], int]:  # the turns on each job's shard, and any on the head
        on_shard = [shards.store_for(j).llen(keys.rollout_calls(j)) for j in ids]
        return on_shard, sum(shards.head.exists(keys.rollout_calls(j)) for j in ids)
    on_shard, on_head = client.call(stored)
    assert on_shard == [TURNS] * JOBS and on_head == 0, (on_shard, on_head)
    nodes = Counter(name.rsplit("@", 1)[-1] for v in views.values() for name in v["workers"].values())
    assert {cluster.node1.name, cluster.node2.name} <= set(nodes), nodes  # both nodes ran stages

    logs = "".join(p.read_text(errors="replace") for p in cluster.logs.glob("*worker-run*.log"))
    cut = cut_stages(logs)
    assert cut, "no stage was cut by the kill: it did not land mid-batch"
    assert set(cut) <= set(on_first), set(cut) - set(on_first)  # only the killed shard's rollouts
    assert all(views[j]["status"] == "completed" for j in cut)  # each cut stage resumed to the end
    after = cluster.head_pids()
    assert {k: v for k, v in after.items() if k != "redis-shard-1"} == \
           {k: v for k, v in before.items() if k != "redis-shard-1"}  # the rest of the head never stopped
    assert cluster.http("GET", "/healthz").json()["store_shards"] == ["ok", "ok"]
    resent = logs.count("sending them again")  # a save that found its shard had lost its last second
    print(f"shard kill across nodes: {dict(statuses)} of {JOBS} ({TURNS} turns each); shard 1 held "
          f"{len(on_first)}; back {back_s:.1f}s after the kill, all ended {ended_s:.1f}s after it; "
          f"stages cut {len(cut)} ({len(set(cut))} jobs); saves that sent lost writes again {resent}; "
          f"stages per node {dict(nodes)}")
