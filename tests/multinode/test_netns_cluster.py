"""More than one node, for real (issue 13, item 6): a head and two worker nodes in network
namespaces on one machine (tests/multinode/cluster.py), bwrap sandboxes on each worker node.

Every address a part publishes (the head file's Redis and API URLs, each sandbox host's URL, the
LLM backend) is reached from the other namespaces, with its secret still required; rollouts spread
over both nodes; then every process of one worker node is killed at once mid-batch and its
namespace removed, and the batch must still end completed on the other node.

Run with ``bash scripts/test.sh -m multinode`` (root: namespaces, veth pairs, a freezer cgroup).
"""
from __future__ import annotations

import ipaddress
import time
import urllib.parse
from collections import Counter

import pytest
import redis
import requests

from prorl_celery import keys
from prorl_celery.jobs import JobStore
from sandboxes.client import live_hosts
from prorl_celery.fakes.problems import MATH
from tests.multinode import netns
from tests.multinode.cluster import Cluster, poll, running

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(900),
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]
SUBNET = ipaddress.ip_network("10.77.0.0/24")
TERMINAL = {"completed", "failed", "cancelled", "timeout"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running(tmp_path_factory.mktemp("multinode")) as built:
        resp = built.http("POST", "/llm_servers", json={"address": built.llm_url})
        assert resp.status_code == 201, resp.text
        yield built


def _host_of(cluster: Cluster, node: netns.Node) -> str:
    found = [h for h, rec in cluster.hosts().items()
             if urllib.parse.urlsplit(rec["address"]).hostname == node.address]
    assert len(found) == 1, f"{node.name}: {cluster.hosts()}"
    return found[0]


def _shell(*commands: str) -> dict:
    return {"data_source": "shell", "commands": list(commands), "sandbox": {"runtime": "bwrap"}}


def test_every_published_address_is_reached_from_the_other_namespaces(cluster):
    head, others = cluster.head, [cluster.node1, cluster.node2, cluster.client]
    redis_at = urllib.parse.urlsplit(cluster.redis_url)
    assert redis_at.hostname == head.address and redis_at.password
    assert urllib.parse.urlsplit(cluster.api).hostname == head.address
    for node in others:
        assert node.call(cluster.redis().ping)
        assert cluster.http("GET", "/healthz", node=node).status_code == 200
        # the secrets are still required on an interface every node reaches
        bare = redis.Redis(host=redis_at.hostname, port=redis_at.port, socket_timeout=5)
        with pytest.raises(redis.AuthenticationError):
            node.call(bare.ping)
        refused = node.call(requests.get, f"{cluster.api}/jobs/x", timeout=10)
        assert refused.status_code == 401, refused.text

    records = {r.host_id: r for r in cluster.client.call(live_hosts, cluster.redis())}
    assert len(records) == 2, records
    by_node = {cluster.node1.name: _host_of(cluster, cluster.node1),
               cluster.node2.name: _host_of(cluster, cluster.node2)}
    for owner, host_id in by_node.items():
        record = records[host_id]
        address = urllib.parse.urlsplit(record.address).hostname
        assert ipaddress.ip_address(address) in SUBNET, record.address  # never loopback
        for node in [head, cluster.node1, cluster.node2, cluster.client]:
            if node.name == owner:
                continue
            assert node.call(requests.get, f"{record.address}/health", timeout=10).ok
            bare = node.call(requests.get, f"{record.address}/sandboxes", timeout=10)
            assert bare.status_code == 401, f"{record.address} from {node.name}: {bare.text}"
            ok = node.call(requests.get, f"{record.address}/sandboxes", timeout=10,
                           headers={"Authorization": f"Bearer {record.token}"})
            assert ok.status_code == 200, f"{record.address} from {node.name}: {ok.text}"
    addresses = [b["address"] for b in cluster.http("GET", "/llm_servers").json()["backends"]]
    assert any(a.rstrip("/").startswith(cluster.llm_url) for a in addresses), addresses
    for node in (cluster.node1, cluster.node2):
        assert node.call(requests.get, f"{cluster.llm_url}/health", timeout=10).ok


def test_rollouts_spread_over_both_worker_nodes(cluster):
    hosts = {_host_of(cluster, cluster.node1), _host_of(cluster, cluster.node2)}
    instances = [_shell("echo one", "sleep 1", "true") for _ in range(12)]
    instances += [{"data_source": "math", **task} for task in MATH[:4]]
    ids = cluster.submit(instances)
    views = cluster.wait_all(ids, 240)
    assert len(views) == len(ids), f"{len(ids) - len(views)} jobs never ended\n{cluster.diagnose()}"
    statuses = Counter(v["status"] for v in views.values())
    assert statuses == {"completed": len(ids)}, {j: v["result"] for j, v in views.items()
                                                 if v["status"] != "completed"}
    used = Counter(v["result"]["sandbox"]["host_id"] for v in views.values())
    assert set(used) == hosts, used
    assert all(v["result"]["sandbox"]["isolation"] for v in views.values())
    workers = Counter(name.rsplit("@", 1)[-1] for v in views.values() for name in v["workers"].values())
    assert {cluster.node1.name, cluster.node2.name} <= set(workers), workers


def test_harness_sessions_reach_their_gateway_from_either_node(cluster):
    """A harness's sandbox and the run worker holding its gateway are often on different nodes
    (placement picks the host, any node's run worker takes the stage): the sandbox's host relays
    the session's socket to the gateway, and every session completes with its calls recorded."""
    from tests.harnesses.test_command import agent_command

    backends = cluster.http("GET", "/llm_servers").json()["backends"]
    cluster.http("POST", "/clear_llm_server")
    resp = cluster.http("POST", "/llm_servers", json={"address": cluster.llm_url, "protocol": "generate",
                                                      "dialect": "fake", "weight_version": "w1"})
    assert resp.status_code == 201, resp.text
    try:
        instances = [{"data_source": "math", **task, "agent": {"harness": "command", "command": agent_command(2),
                                                              "wall_s": 120}} for task in (MATH * 3)[:12]]
        ids = cluster.submit(instances)
        views = cluster.wait_all(ids, 300)
    finally:
        cluster.http("POST", "/clear_llm_server")
        for backend in backends:
            cluster.http("POST", "/llm_servers", json={"address": backend["address"]})
    assert len(views) == len(ids), f"{len(ids) - len(views)} jobs never ended\n{cluster.diagnose()}"
    failed = {j: v["result"] for j, v in views.items() if v["status"] != "completed"}
    assert not failed, failed
    node_of_host = {_host_of(cluster, node): node.name for node in (cluster.node1, cluster.node2)}
    routes = Counter()
    for view in views.values():
        result = view["result"]
        assert result["turns"] == 2 and result["token_mode"] == "exact", result["harness"]
        assert "calls done" in result["harness"]["output"], result["harness"]["output"]
        sandbox_node = node_of_host[result["sandbox"]["host_id"]]
        run_node = view["workers"]["run"].rsplit("@", 1)[-1]
        expected = "direct" if sandbox_node == run_node else "relay"
        assert result["harness"]["route"] == expected, (sandbox_node, run_node, result["harness"])
        routes[expected] += 1
    assert routes["relay"] >= 1, routes  # 12 sessions, random placement: a node's worker drove another's sandbox
    for node in (cluster.node1, cluster.node2):  # every session's socket and relay went with it
        assert not list(cluster.gateway_dir(node).glob("*.sock")), node.name


def test_killing_a_worker_node_mid_batch(cluster):
    survivor, doomed = cluster.node1, cluster.node2
    survivor_host, doomed_host = _host_of(cluster, survivor), _host_of(cluster, doomed)
    ids = cluster.submit([_shell("sleep 6", "true") for _ in range(16)])
    store = JobStore(cluster.redis())

    def on_doomed(status: str | None = "run") -> list[str]:
        records = [store.get(j) for j in ids]
        return [r.job_id for r in records if r and r.sandbox and r.sandbox.get("host_id") == doomed_host
                and (status is None or r.status.value == status)]
    poll(lambda: len(cluster.client.call(on_doomed)) >= 2, 120,
         "rollouts running in sandboxes of the node to kill", cluster.diagnose)

    lost = cluster.client.call(on_doomed, None)
    doomed.kill_all()  # everything started on the node, its sandboxes included, at once
    killed_at = time.monotonic()
    assert doomed.members() == [] and doomed.netns_pids() == []
    doomed.destroy()
    cluster.fabric.nodes.remove(doomed)
    cluster.reap_cgroups(doomed)
    assert not doomed.exists()
    poll(lambda: set(cluster.hosts()) == {survivor_host}, 30, "the dead host to leave /healthz")

    views = cluster.wait_all(ids, 300)
    print(f"all {len(ids)} ended {time.monotonic() - killed_at:.1f}s after the kill; "
          f"{len(lost)} had their sandbox on the killed node")
    assert len(views) == len(ids), f"{len(ids) - len(views)} jobs never ended\n{cluster.diagnose()}"
    for job_id, view in views.items():
        t = view["result"]["timing"]
        print(f"  {job_id[:8]} {view['status']} attempts={len(view['result']['attempts'])} "
              + " ".join(f"{k}={v:.1f}" for k, v in t.items() if isinstance(v, (int, float))))
    not_completed = {j: (v["status"], v["result"].get("critical_error"), v["result"].get("error"))
                     for j, v in views.items() if v["status"] != "completed"}
    assert not not_completed, not_completed
    assert all(v["result"]["sandbox"]["host_id"] == survivor_host for v in views.values())
    for job_id in lost:  # re-run from init on the survivor, the lost attempt recorded
        attempts = views[job_id]["result"]["attempts"]
        assert len(attempts) >= 2 and attempts[-1]["host"] == survivor_host, attempts
        assert any(a["host"] == doomed_host and a["fault"] for a in attempts[:-1]), attempts
    # one completion per job in the stream, whatever ran twice
    entries = cluster.client.call(cluster.redis().xrange, keys.completions())
    counts = Counter(e[b"job_id"].decode() for _, e in entries)
    assert all(counts[j] == 1 for j in ids), {j: counts[j] for j in ids if counts[j] != 1}
