"""Plan the set elements that let a sandbox reach the IPs of an allowed DNS answer.

An element is ``ip . proto . port``: the IP alone would open every port, so each IP is
paired with the ports of the rule that allowed its name.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from egress.model import IPAddress, Policy, Ports


@dataclass(frozen=True)
class SetUpdate:
    """One batch for the kernel: elements for allow4 and allow6 with one timeout."""

    elements4: tuple[str, ...]
    elements6: tuple[str, ...]
    timeout_s: int

    def is_empty(self) -> bool:
        return not self.elements4 and not self.elements6


def clamp_ttl(ttl: int, policy: Policy) -> int:
    """How long a learned IP stays allowed: the answer's TTL within the policy's bounds."""
    return max(policy.dns.ttl_min, min(ttl, policy.dns.ttl_max))


def port_pairs(ports: Ports) -> list[str]:
    pairs: list[str] = []
    for proto, ranges in (("tcp", ports.tcp), ("udp", ports.udp)):
        for r in ranges:
            pairs.extend(f"{proto} . {p}" for p in range(r.first, r.last + 1))
    return pairs


def plan_update(ips: Iterable[IPAddress], ports: Ports, timeout_s: int) -> SetUpdate:
    pairs = port_pairs(ports)
    v4: list[str] = []
    v6: list[str] = []
    for ip in ips:
        target = v4 if ip.version == 4 else v6
        target.extend(f"{ip} . {pair}" for pair in pairs)
    return SetUpdate(tuple(v4), tuple(v6), timeout_s)


def parse_ips(texts: Iterable[str]) -> list[IPAddress]:
    return [ipaddress.ip_address(t) for t in texts]
