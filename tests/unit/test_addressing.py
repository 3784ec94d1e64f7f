"""Address blocks for sandboxes: pools, allocation around what other sandboxes hold."""

from __future__ import annotations

import ipaddress
import random

import pytest

from egress.datapath.addressing import Pools, add_range, first_free, merged
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


def _brute_first_free(
    pools: Pools, used: list[ipaddress.IPv4Network | ipaddress.IPv6Network]
) -> int:
    for i in range(pools.capacity):
        net = pools.network(i)
        if not any(net.net4.overlaps(u) if u.version == 4 else net.net6.overlaps(u) for u in used):
            return i
    return -1


def test_first_free_agrees_with_checking_every_pair() -> None:
    """Random used sets (neighbours, overlaps, supernets, other families, other pools):
    the indexed search picks exactly the network the definition does."""
    rng = random.Random(7)
    pools = Pools.parse("10.99.0.0/26,fd00:1::/60")
    for _ in range(500):
        used: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for _ in range(rng.randrange(0, 20)):
            if rng.random() < 0.5:
                prefix = rng.choice([24, 27, 29, 30, 31, 32])
                base = ipaddress.ip_address("10.99.0.0") + rng.randrange(0, 96)
                used.append(ipaddress.ip_network(f"{base}/{prefix}", strict=False))
            else:
                prefix = rng.choice([56, 60, 63, 64, 65, 128])
                base = ipaddress.ip_address("fd00:1::") + (rng.randrange(0, 20) << 64)
                used.append(ipaddress.ip_network(f"{base}/{prefix}", strict=False))
        want = _brute_first_free(pools, used)
        if want < 0:
            with pytest.raises(SandboxError):
                first_free(pools, used)
        else:
            assert first_free(pools, used) == pools.network(want), used


def test_ranges_merged_one_span_at_a_time_equal_those_merged_at_once() -> None:
    """add_range (a claim index's own claims, one per create) keeps exactly what merged
    makes of all the spans: touching, overlapping, nested, duplicate and lone ones."""
    rng = random.Random(11)
    for _ in range(2000):
        spans = []
        for _ in range(rng.randrange(1, 25)):
            first = rng.randrange(0, 200)
            spans.append((first, first + rng.choice([0, 0, 1, 3, 3, 7, 30])))
        taken = merged([])
        for span in spans:
            add_range(taken, span)
        assert taken == merged(spans), spans
