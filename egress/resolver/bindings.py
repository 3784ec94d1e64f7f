"""Which names put an address into a sandbox's sets, and until when.

An address learned from DNS is a whole host: behind a CDN it serves thousands of names,
so allowing the address allows them all. What a connection to it asks for (its TLS SNI
or HTTP Host, ``datapath.firstbytes``) is checked against this table (``flows``): the
name must be one whose answer put this address into this sandbox's sets, the question
or a name on its CNAME chain, and that answer's kernel timeout must not have passed.

The resolver core records an answer here when the kernel has acked its set elements,
with the same timeout, so a name is bound exactly while its addresses are allowed for
it. Each sandbox has its own table: another sandbox's answers bind nothing here.

Bounded: ``max_addresses`` addresses with ``max_names`` names each. A full table first
drops what has expired, then the eighth of its addresses learned longest ago; a full
address replaces its name that expires first. Forgetting only ever turns a later flow
into a mismatch (fail closed), never into a pass. Full, the table holds 2.1 MB when its
addresses share their names (one answer binds its names to all of its addresses) and
13.6 MB at the very worst: 8 distinct 253-character names on each address, which takes
32,768 unique long names, far more than the tunnel scorer lets a sandbox ask.

Each binding keeps the ports of the rule the answer came through: the kernel's elements
allow the address on those, and a flow to another port (allowed through another name's
rule) must not pass as this name.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

from egress.model import IPAddress, Ports

MAX_ADDRESSES = 4096
MAX_NAMES = 8  # per address: a CDN address a sandbox reaches under several names


class Bindings:
    def __init__(self, max_addresses: int = MAX_ADDRESSES, max_names: int = MAX_NAMES) -> None:
        if max_addresses < 1 or max_names < 1:
            raise ValueError("a bindings table holds at least one address and one name")
        self.max_addresses = max_addresses
        self.max_names = max_names
        # address -> {name: (until, ports)}; dict order is learning order (refreshed on
        # re-learn). ``ports``: those of the rule the answer came through, which are what
        # the kernel's set elements for the address allow.
        self._table: dict[IPAddress, dict[str, tuple[float, Ports]]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def learn(
        self,
        ips: Iterable[IPAddress],
        names: Iterable[str],
        ports: Ports,
        now: float,
        until: float,
    ) -> None:
        """Bind each of ``names`` to each of ``ips``, on ``ports``, from ``now`` until
        ``until``; an earlier binding of the same pair on the same ports is kept if it
        lasts longer (on other ports, the new answer's replace it)."""
        wanted = [_key(name) for name in names]
        if not wanted:
            return
        for ip in ips:
            bound = self._table.pop(ip, None)
            if bound is None:
                if len(self._table) >= self.max_addresses:
                    self._make_room(now)
                bound = {}
            self._table[ip] = bound  # to the end: the most recently learned
            for name in wanted:
                old = bound.get(name)
                if old is not None and old[1] == ports and old[0] >= until:
                    continue
                if old is None and len(bound) >= self.max_names:
                    del bound[min(bound, key=lambda n: bound[n][0])]
                bound[name] = (until, ports)

    def names(self, ip: IPAddress, now: float) -> tuple[str, ...]:
        """The names bound to ``ip`` at ``now``, in the order they were learned."""
        bound = self._table.get(ip)
        return tuple(n for n, (until, _) in bound.items() if until > now) if bound else ()

    def bound(self, ip: IPAddress, name: str, port: int, now: float) -> bool:
        """``name`` is bound to ``ip`` at ``now``, for TCP ``port``."""
        found = self._table.get(ip, {}).get(_key(name))
        if found is None or found[0] <= now:
            return False
        return any(r.first <= port <= r.last for r in found[1].tcp)

    def _make_room(self, now: float) -> None:
        """Drop what expired; if that is not enough, the eighth learned longest ago (so
        the scan runs once per ``max_addresses / 8`` new addresses, not for each)."""
        expired = [
            ip for ip, bound in self._table.items() if max(u for u, _ in bound.values()) <= now
        ]
        for ip in expired:
            del self._table[ip]
        if len(self._table) >= self.max_addresses:
            for ip in list(islice(self._table, max(1, self.max_addresses // 8))):
                del self._table[ip]


def _key(name: str) -> str:
    return name.lower().rstrip(".")
