"""Pod IPs come from the node's pod CIDR, the lowest free one first."""

from __future__ import annotations

import ipaddress
import re

import pytest

from elasticjob_devcluster.sandbox import free_ip


def test_the_first_address_is_left_to_the_gateway_and_used_ones_are_skipped() -> None:
    net = ipaddress.ip_network("10.244.1.0/24")
    assert free_ip(net, set()) == "10.244.1.2"
    assert free_ip(net, {"10.244.1.2", "10.244.1.3"}) == "10.244.1.4"


def test_a_full_cidr_says_so() -> None:
    net = ipaddress.ip_network("10.244.1.0/30")  # hosts .1 and .2; .1 is the gateway's
    with pytest.raises(RuntimeError, match=re.escape("pod CIDR 10.244.1.0/30 is full")):
        free_ip(net, {"10.244.1.2"})
