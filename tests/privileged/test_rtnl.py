"""egress.kernel.rtnl's hand-packed rtnetlink batches against the real kernel: what they
make is what `ip` shows, and a refused request is named."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

from egress.errors import SandboxError
from egress.kernel import netns, rtnl
from tests.support.netns import ifname, scratch_netns

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]


@pytest.fixture
def two() -> Iterator[tuple[str, str]]:
    with scratch_netns() as outer, scratch_netns() as inner:
        yield outer, inner


def ip(ns: str, *args: str) -> list[dict[str, object]]:
    out = subprocess.run(["ip", "-j", "-n", ns, *args], capture_output=True, check=True)
    return json.loads(out.stdout or b"[]")  # type: ignore[no-any-return]


def veth(outer: str, inner: str, host: str, peer: str) -> None:
    batch = rtnl.Batch()
    fd = os.open(netns.netns_path(inner), os.O_RDONLY | os.O_CLOEXEC)
    try:
        batch.veth(host, peer, fd)
        with rtnl.opened(outer) as r:
            r.run(batch)
    finally:
        os.close(fd)


def test_a_veth_with_addresses_and_default_routes_is_what_ip_shows(
    two: tuple[str, str],
) -> None:
    outer, inner = two
    host, peer = ifname("h"), ifname("p")
    veth(outer, inner, host, peer)
    with rtnl.opened(outer) as out, rtnl.opened(inner) as ins:
        index = out.index(host)
        b = rtnl.Batch()
        b.address(index, host, "10.77.0.1/30")
        b.address(index, host, "fd00:77::1/64")
        b.up(index, host)
        out.run(b)
        pindex = ins.index(peer)
        b = rtnl.Batch()
        b.up(rtnl.LOOPBACK_INDEX, "lo")
        b.address(pindex, peer, "10.77.0.2/30")
        b.address(pindex, peer, "fd00:77::2/64")
        b.up(pindex, peer)
        b.default_route("10.77.0.1", pindex)
        b.default_route("fd00:77::1", pindex)
        ins.run(b)
    [link] = ip(outer, "link", "show", host)
    assert link["ifindex"] == index and "UP" in link["flags"]  # type: ignore[operator]
    [plink] = ip(inner, "addr", "show", peer)
    assert plink["ifindex"] == pindex and "UP" in plink["flags"]  # type: ignore[operator]
    addrs = {(a["local"], a["prefixlen"]): a for a in plink["addr_info"]}  # type: ignore[attr-defined]
    assert set(addrs) >= {("10.77.0.2", 30), ("fd00:77::2", 64)}
    assert addrs[("fd00:77::2", 64)].get("nodad") is True  # usable at once, no DAD wait
    assert "UP" in ip(inner, "link", "show", "lo")[0]["flags"]  # type: ignore[operator]
    for family, gw in (("-4", "10.77.0.1"), ("-6", "fd00:77::1")):
        [route] = ip(inner, family, "route", "show", "default")
        assert route["gateway"] == gw and route["dev"] == peer and route["protocol"] == "static"
    # The wiring carries traffic: the peer reaches the host end over both families.
    for family, addr in ((socket.AF_INET, "10.77.0.1"), (socket.AF_INET6, "fd00:77::1")):
        with netns.in_netns(outer):
            server = socket.socket(family, socket.SOCK_STREAM)
        with server:
            server.bind((addr, 0))
            server.listen()
            with netns.in_netns(inner):
                client = socket.create_connection(server.getsockname()[:2], timeout=10)
            client.close()


def test_a_refused_request_is_named_and_the_others_of_its_batch_still_run(
    two: tuple[str, str],
) -> None:
    outer, _ = two
    with rtnl.opened(outer) as r:
        b = rtnl.Batch()
        b.up(rtnl.LOOPBACK_INDEX, "lo")
        b.address(999_999, "nosuch0", "10.78.0.1/24")
        b.address(rtnl.LOOPBACK_INDEX, "lo", "10.78.1.1/24")
        with pytest.raises(
            SandboxError, match=r"add address 10\.78\.0\.1/24 to nosuch0 in .*errno 19"
        ):
            r.run(b)
        # The socket is in step after an error: the next request gets its own answer.
        assert r.index("lo") == rtnl.LOOPBACK_INDEX
        with pytest.raises(SandboxError, match="no link nosuch0"):
            r.index("nosuch0")
    assert ("10.78.1.1", 24) in {
        (a["local"], a["prefixlen"])
        for a in ip(outer, "addr", "show", "lo")[0]["addr_info"]  # type: ignore[attr-defined]
    }


def test_a_taken_name_refuses_the_veth(two: tuple[str, str]) -> None:
    outer, inner = two
    host = ifname("h")
    veth(outer, inner, host, ifname("p"))
    with pytest.raises(SandboxError, match=rf"create veth {host}/.*\(errno 17\)"):
        veth(outer, inner, host, ifname("q"))


def test_a_pinned_neighbour_is_permanent_at_the_address_link_reads(
    two: tuple[str, str],
) -> None:
    """A veth made with its MACs has them, set (not random: udev leaves a set address
    alone); ``link`` reads them; ``neighbour`` makes a permanent entry, and made again
    with another MAC puts it in place of the first."""
    outer, inner = two
    host, peer = ifname("h"), ifname("p")
    mac, pmac = bytes.fromhex("02aabbccdd01"), bytes.fromhex("02aabbccdd02")
    fd = os.open(netns.netns_path(inner), os.O_RDONLY | os.O_CLOEXEC)
    try:
        made = rtnl.Batch()
        made.veth(host, peer, fd, (mac, pmac))
        with rtnl.opened(outer) as r:
            r.run(made)
    finally:
        os.close(fd)
    for ns, dev in ((outer, host), (inner, peer)):
        argv = ["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/addr_assign_type"]
        kind = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        assert kind.strip() == "3", (dev, kind)  # NET_ADDR_SET
    with rtnl.opened(outer) as out, rtnl.opened(inner) as ins:
        index, got = out.link(host)
        pindex, pgot = ins.link(peer)
        assert (got, pgot) == (mac, pmac)
        assert (index, pindex) == (out.index(host), ins.index(peer))
        b = rtnl.Batch()
        b.address(index, host, "10.79.0.1/30")
        b.up(index, host)
        for address in ("10.79.0.2", "fd00:79::2"):
            b.neighbour(index, host, address, bytes.fromhex("020000000001"))
            b.neighbour(index, host, address, pmac)  # replaces the first
        out.run(b)
    entries = {(n["dst"], n.get("lladdr"), tuple(n["state"]))  # type: ignore[arg-type]
               for n in ip(outer, "neigh", "show", "dev", host)}  # fmt: skip
    assert entries == {
        ("10.79.0.2", pmac.hex(":"), ("PERMANENT",)),
        ("fd00:79::2", pmac.hex(":"), ("PERMANENT",)),
    }
