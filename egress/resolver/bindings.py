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
into a mismatch (fail closed), never into a pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

from egress.model import IPAddress

MAX_ADDRESSES = 4096
MAX_NAMES = 16  # per address: a CDN address a sandbox reaches under many names


class Bindings:
    def __init__(self, max_addresses: int = MAX_ADDRESSES, max_names: int = MAX_NAMES) -> None:
        self.max_addresses = max_addresses
        self.max_names = max_names
        # address -> {name: until}; dict order is learning order (refreshed on re-learn)
        self._table: dict[IPAddress, dict[str, float]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def learn(
        self, ips: Iterable[IPAddress], names: Iterable[str], now: float, until: float
    ) -> None:
        """Bind each of ``names`` to each of ``ips`` from ``now`` until ``until``; an
        earlier binding of the same pair is kept if it lasts longer."""
        wanted = [_key(name) for name in names]
        for ip in ips:
            bound = self._table.pop(ip, None)
            if bound is None:
                if len(self._table) >= self.max_addresses:
                    self._make_room(now)
                bound = {}
            self._table[ip] = bound  # to the end: the most recently learned
            for name in wanted:
                if bound.get(name, -1.0) >= until:
                    continue
                if name not in bound and len(bound) >= self.max_names:
                    del bound[min(bound, key=bound.__getitem__)]
                bound[name] = until

    def names(self, ip: IPAddress, now: float) -> tuple[str, ...]:
        """The names bound to ``ip`` at ``now``, in the order they were learned."""
        bound = self._table.get(ip)
        return tuple(n for n, until in bound.items() if until > now) if bound else ()

    def bound(self, ip: IPAddress, name: str, now: float) -> bool:
        bound = self._table.get(ip)
        return bound is not None and bound.get(_key(name), 0.0) > now

    def _make_room(self, now: float) -> None:
        """Drop what expired; if that is not enough, the eighth learned longest ago (so
        the scan runs once per ``max_addresses / 8`` new addresses, not for each)."""
        for ip in [ip for ip, bound in self._table.items() if max(bound.values()) <= now]:
            del self._table[ip]
        if len(self._table) >= self.max_addresses:
            for ip in list(islice(self._table, max(1, self.max_addresses // 8))):
                del self._table[ip]


def _key(name: str) -> str:
    return name.lower().rstrip(".")
