"""egress.kernel.conntrack against the real kernel: of a netns's conntrack entries, exactly
those whose flow began from an address not the netns's own are deleted, IPv4 and IPv6."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from egress.kernel import conntrack
from tests.support.netns import scratch_netns

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

# Conntrack runs in a netns once a rule there needs it.
TRACKED = """
table inet t {
    chain output {
        type filter hook output priority filter; policy accept;
        ct state established accept
    }
}
"""
# Flows over lo: from the netns's own addresses (v4 and v6), and from a server's address
# bound with IPV6_FREEBIND (the scratch netns has no route to answer it by).
FLOWS = """
import socket
def flow(family, src, dst):
    b = socket.socket(family, socket.SOCK_DGRAM); b.bind((dst, 0))
    a = socket.socket(family, socket.SOCK_DGRAM)
    if family == socket.AF_INET6:
        a.setsockopt(socket.IPPROTO_IPV6, 78, 1)
    a.bind((src, 4444)); a.sendto(b"x", b.getsockname()[:2])
    b.recvfrom(10)
flow(socket.AF_INET, "127.0.0.1", "127.0.0.1")
flow(socket.AF_INET6, "::1", "::1")
flow(socket.AF_INET6, "2001:db8:80::10", "::1")
"""


@pytest.fixture
def ns() -> Iterator[str]:
    with scratch_netns() as name:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", name, "nft", "-f", "-"], input=TRACKED,
                       text=True, check=True)  # fmt: skip
        yield name


def sources(ns: str) -> list[str]:
    """The original sources of the netns's UDP entries to or from port 4444."""
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/nf_conntrack"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return sorted(line.split("src=")[1].split()[0] for line in out.splitlines()
                  if " udp " in line and "sport=4444" in line)  # fmt: skip


def test_only_the_flow_from_an_address_the_netns_does_not_hold_is_forgotten(ns: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", FLOWS], check=True)
    full = "2001:0db8:0080:0000:0000:0000:0000:0010"
    assert sources(ns) == ["0000:0000:0000:0000:0000:0000:0000:0001", "127.0.0.1", full]
    assert conntrack.forget_foreign(ns) == ["2001:db8:80::10"]
    assert sources(ns) == ["0000:0000:0000:0000:0000:0000:0000:0001", "127.0.0.1"]
    assert conntrack.forget_foreign(ns) == []
