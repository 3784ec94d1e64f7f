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
# Flows over lo: from the netns's own addresses (v4 and v6); from a server's address, bound
# with IPV6_FREEBIND and (as root may) IP_TRANSPARENT; and 300 more from its own, so the
# dump takes several reads. The scratch netns has no route to answer the foreign ones.
FLOWS = """
import socket
def flow(family, src, dst, port=4444, opt=None):
    b = socket.socket(family, socket.SOCK_DGRAM); b.settimeout(5); b.bind((dst, 0))
    a = socket.socket(family, socket.SOCK_DGRAM)
    if opt: a.setsockopt(*opt)
    a.bind((src, port)); a.sendto(b"x", b.getsockname()[:2]); b.recv(10)
    a.close(); b.close()
flow(socket.AF_INET, "127.0.0.1", "127.0.0.1")
flow(socket.AF_INET6, "::1", "::1")
flow(socket.AF_INET6, "2001:db8:80::10", "::1", opt=(socket.IPPROTO_IPV6, 78, 1))
flow(socket.AF_INET, "198.51.100.7", "127.0.0.1", opt=(socket.SOL_IP, 19, 1))
for _ in range(300):
    flow(socket.AF_INET, "127.0.0.1", "127.0.0.1", port=0)
"""


@pytest.fixture
def ns() -> Iterator[str]:
    with scratch_netns() as name:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", name, "nft", "-f", "-"], input=TRACKED,
                       text=True, check=True)  # fmt: skip
        yield name


def sources(ns: str) -> tuple[list[str], int]:
    """The original sources of the netns's UDP entries from port 4444, and how many UDP
    entries it has in all."""
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/nf_conntrack"],
                         capture_output=True, text=True, check=True, timeout=30).stdout  # fmt: skip
    udp = [line for line in out.splitlines() if " udp " in line]
    ours = [line.split("src=")[1].split()[0] for line in udp if " sport=4444 " in line]
    return sorted(ours), len(udp)


def test_only_the_flows_from_addresses_the_netns_does_not_hold_are_forgotten(ns: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", FLOWS], check=True,
                   timeout=60)  # fmt: skip
    loopback6 = "0000:0000:0000:0000:0000:0000:0000:0001"
    server6 = "2001:0db8:0080:0000:0000:0000:0000:0010"
    assert sources(ns) == ([loopback6, "127.0.0.1", "198.51.100.7", server6], 304)
    assert sorted(conntrack.forget_foreign(ns)) == ["198.51.100.7", "2001:db8:80::10"]
    assert sources(ns) == ([loopback6, "127.0.0.1"], 302)
    assert conntrack.forget_foreign(ns) == []


def test_what_an_adopter_says_of_the_flows_it_forgot_or_could_not() -> None:
    """lifecycle.forget_spoofed_flows, the line egressd prints when it adopts a sandbox
    made before the source check: how many it forgot, nothing if none, and, when the
    kernel could not be asked (here: the netns went meanwhile), that such flows may go
    on, naming the netns."""
    from egress.sandbox.lifecycle import forget_spoofed_flows

    with scratch_netns() as name:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", name, "nft", "-f", "-"], input=TRACKED,
                       text=True, check=True)  # fmt: skip
        subprocess.run(["ip", "netns", "exec", name, sys.executable, "-c", FLOWS], check=True,
                       timeout=60)  # fmt: skip
        assert forget_spoofed_flows(name) == "2 flows from other sources than its own forgotten"
        assert forget_spoofed_flows(name) == ""
    said = forget_spoofed_flows(name)
    assert said.startswith("flows from other sources than its own may go on until they end: ")
    assert name in said
