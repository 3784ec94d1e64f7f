"""Plan the set elements that let a sandbox reach the IPs of an allowed DNS answer.

An element is ``ip . proto . port``: the IP alone would open every port, so each IP is
paired with the ports of the rule that allowed its name.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable
from dataclasses import dataclass

from egress.datapath.constants import ALLOW4, ALLOW6
from egress.model import IPAddress, Policy, Ports


@dataclass(frozen=True)
class SetUpdate:
    """One batch for the kernel: elements for allow4 and allow6 with one timeout."""

    elements4: tuple[str, ...]
    elements6: tuple[str, ...]
    timeout_s: int

    def is_empty(self) -> bool:
        return not self.elements4 and not self.elements6

    def by_set(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(set name, elements) for allow4 and allow6, in that order."""
        return ((ALLOW4, self.elements4), (ALLOW6, self.elements6))


@dataclass(frozen=True, slots=True)
class SetAdd:
    """One add for the kernel: these elements into one set, with one timeout."""

    set_name: str  # ALLOW4 or ALLOW6
    elements: tuple[str, ...]
    timeout_s: int


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
        text = str(ip)  # once per address, not per port: ipaddress formats in Python
        target.extend(f"{text} . {pair}" for pair in pairs)
    return SetUpdate(tuple(v4), tuple(v6), timeout_s)


def element_parts(key: str) -> tuple[IPAddress, str, int] | None:
    """An allow set's element key, ``IP . PROTO . PORT`` (``plan_update``'s form, and
    how nft lists them), as its parts; None if it is not one."""
    parts = key.split(" . ")
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    try:
        return ipaddress.ip_address(parts[0]), parts[1], int(parts[2])
    except ValueError:
        return None


def parse_ips(texts: Iterable[str]) -> list[IPAddress]:
    return [ipaddress.ip_address(t) for t in texts]


class ExpiryBook:
    """When each set element the resolver added will expire, so a later answer never
    shortens it.

    The kernel replaces an element's timeout when it is added again, also with a shorter
    one: two names sharing an address with different TTLs would otherwise cut the first
    client's connection short. Bounded: expired entries are dropped as it grows.
    """

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._expiry: dict[str, float] = {}

    def plan(self, elements: tuple[str, ...], timeout_s: int, now: float) -> dict[int, list[str]]:
        """Group elements by the timeout each needs: the new one, or longer if an earlier
        answer already allows it for longer."""
        groups: dict[int, list[str]] = {}
        for e in elements:
            left = self._expiry.get(e, 0.0) - now
            need = max(timeout_s, math.ceil(left)) if left > 0 else timeout_s
            groups.setdefault(need, []).append(e)
        return groups

    def plan_adds(self, update: SetUpdate, now: float) -> tuple[SetAdd, ...]:
        """``update`` as the adds that carry it out: per set, one per timeout needed."""
        return tuple(
            SetAdd(set_name, tuple(group), timeout)
            for set_name, elements in update.by_set()
            for timeout, group in self.plan(elements, update.timeout_s, now).items()
        )

    def fresh_update(self, update: SetUpdate, now: float) -> SetUpdate:
        """The part of ``update`` no earlier answer allows right now (safe to take back)."""
        fresh4 = tuple(self.fresh(update.elements4, now))
        return SetUpdate(fresh4, tuple(self.fresh(update.elements6, now)), 0)

    def fresh(self, elements: tuple[str, ...], now: float) -> list[str]:
        """The elements no earlier answer allows right now (the ones safe to take back)."""
        return [e for e in elements if self._expiry.get(e, 0.0) <= now]

    def record(self, elements: list[str] | tuple[str, ...], timeout_s: int, now: float) -> None:
        for e in elements:
            self._expiry[e] = max(self._expiry.get(e, 0.0), now + timeout_s)
        if len(self._expiry) > self.max_entries:
            self._expiry = {k: v for k, v in self._expiry.items() if v > now}

    def __len__(self) -> int:
        return len(self._expiry)
