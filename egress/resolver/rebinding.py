"""Which answer addresses are rebinding targets.

An allowed name that answers with a loopback, private, link-local (cloud metadata lives at
169.254.169.254), unique-local, CGNAT, multicast or unspecified address would let a
sandbox reach the host's own network through DNS. Python's ``ipaddress.is_private`` also
counts the documentation and benchmarking ranges, which labs use on purpose, so the list
is spelled out here instead.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from egress.model import IPAddress, IPNetwork

_V4 = [
    ("unspecified", "0.0.0.0/8"),
    ("private", "10.0.0.0/8"),
    ("CGNAT", "100.64.0.0/10"),
    ("loopback", "127.0.0.0/8"),
    ("link-local", "169.254.0.0/16"),
    ("private", "172.16.0.0/12"),
    ("IETF protocol assignments", "192.0.0.0/24"),
    ("private", "192.168.0.0/16"),
    ("multicast", "224.0.0.0/4"),
    ("reserved", "240.0.0.0/4"),
]
_V6 = [
    ("unspecified", "::/128"),
    ("loopback", "::1/128"),
    ("unique-local", "fc00::/7"),
    ("link-local", "fe80::/10"),
    ("site-local", "fec0::/10"),
    ("multicast", "ff00::/8"),
]
BLOCKED: list[tuple[str, IPNetwork]] = [(why, ipaddress.ip_network(n)) for why, n in _V4 + _V6]
# The same as (reason, network, first address, mask) integers per version: every allowed
# answer's addresses go through this before the client may see them.
_BY_VERSION: dict[int, list[tuple[str, IPNetwork, int, int]]] = {4: [], 6: []}
for _why, _net in BLOCKED:
    _BY_VERSION[_net.version].append((_why, _net, int(_net.network_address), int(_net.netmask)))
_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address inside a v4-mapped, v4-compatible or NAT64 IPv6 address."""
    if ip in _MAPPED or ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if int(ip) >> 32 == 0 and int(ip) > 1:  # deprecated ::a.b.c.d
        return ipaddress.IPv4Address(int(ip))
    return None


def rebinding_reason(ip: IPAddress, exempt: Iterable[IPNetwork] = ()) -> str | None:
    """Why ``ip`` may not be handed to a sandbox, or None when it may."""
    if any(ip.version == net.version and ip in net for net in exempt):
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        inner = embedded_v4(ip)
        if inner is not None:
            why = rebinding_reason(inner, exempt)
            return f"{why} (embedded in {ip})" if why else None
    value = int(ip)
    for why, net, first, mask in _BY_VERSION[ip.version]:
        if value & mask == first:
            return f"{why} {net}"
    return None
