"""Address blocks for sandboxes: pools, allocation around what other sandboxes hold."""

from __future__ import annotations

import ipaddress

import pytest

from egress.datapath.addressing import Pools, first_free
from egress.errors import SandboxError


def test_default_pools_give_a_30_and_a_64_per_sandbox() -> None:
    pools = Pools.parse(None)
    net = pools.network(3)
    assert str(net.net4) == "10.231.0.12/30" and str(net.net6) == "fd00:e9e5:5000:3::/64"
    assert str(net.gateway4) == "10.231.0.13" and str(net.address4) == "10.231.0.14"
    assert str(net.gateway6) == "fd00:e9e5:5000:3::1"


def test_first_free_skips_blocks_other_sandboxes_hold_even_from_another_pool() -> None:
    pools = Pools.parse("10.99.0.0/29")
    held = [ipaddress.ip_network("10.99.0.0/30"), ipaddress.ip_network("fd00:1::/64")]
    assert str(first_free(pools, held).net4) == "10.99.0.4/30"
    # A sandbox of the default pool holds nothing of this one: it does not count.
    other = [ipaddress.ip_network("10.231.0.0/30"), ipaddress.ip_network("fd00:9::/64")]
    assert str(first_free(pools, other).net4) == "10.99.0.0/30"


def test_an_exhausted_pool_says_what_to_do() -> None:
    pools = Pools.parse("10.99.0.0/30")
    with pytest.raises(SandboxError, match=r"subnet pool exhausted.*--subnet-pool"):
        first_free(pools, [ipaddress.ip_network("10.99.0.0/30")])


@pytest.mark.parametrize("spec", ["10.0.0.0/31", "fd00::/65", "nonsense", "10.0.0.1/24"])
def test_bad_pools_are_refused(spec: str) -> None:
    with pytest.raises(SandboxError, match="--subnet-pool"):
        Pools.parse(spec)
