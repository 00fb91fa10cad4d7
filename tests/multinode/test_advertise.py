"""What a sandbox host publishes (sandboxes/host/advertise.py), and the loopback default for one node.
Fast: the namespace cases build two namespaces and open no server."""
from __future__ import annotations

import argparse
import ipaddress

import pytest

from config.settings import Settings
from sandboxes.host import advertise
from sandboxes.host.main import add_arguments
from tests.multinode import netns


def test_one_interface_is_published_as_bound():
    assert advertise.advertised_url("10.1.2.3", 8710, "redis://:pw@10.9.9.9:6379/0") == \
        "http://10.1.2.3:8710"
    assert advertise.advertised_url("fd00::5", 8710, None) == "http://[fd00::5]:8710"


def test_the_operator_address_wins_when_bound_to_all():
    assert advertise.advertised_url("0.0.0.0", 8710, "redis://:pw@10.9.9.9:6379/0",
                                    node_addr="node7.cluster") == "http://node7.cluster:8710"


def test_single_node_defaults_stay_on_loopback():
    assert Settings().sandbox_host_bind == "127.0.0.1"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).host is None  # main() then binds settings.sandbox_host_bind
    # bound to all with Redis on loopback: this node's own address, else loopback (one node)
    found = advertise.node_address("redis://:pw@127.0.0.1:6379/0")
    assert ipaddress.ip_address(found)


@pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
def test_bound_to_all_publishes_the_route_to_redis_never_loopback():
    with netns.fabric("10.78.0") as fabric:
        fabric.node("head", 1)
        node = fabric.node("node", 2)
        url = "redis://:pw@10.78.0.1:6379/0"
        assert node.call(advertise.advertised_url, "0.0.0.0", 8710, url) == "http://10.78.0.2:8710"
        assert node.call(advertise.route_source, "10.78.0.1", 6379) == "10.78.0.2"
        # no route to Redis at all (an unplugged node): not the route's loopback either
        assert node.call(advertise.route_source, "10.99.0.1", 6379) is None
