"""Queries the observer judged allowed, kept by their bytes so a repeat is not parsed.

A DNS client asks the same few names again and again; the resolver answers the repeats
from its cache (``ResolverCore.replay``) and the observer, which judges its own copy of
every query, would parse each one and run the matcher and the tunnel scorer on it. The
same bytes after the ID are the same question, flags and EDNS, so the same verdict: a
repeat of one allowed within the last REPLAY_S is allowed without being parsed. That is
exact for the matcher, whose policy does not change under an observer (a swap starts
a new one), and for the tunnel scorer, whose limits count only names and pairs it has
not seen: a repeat adds nothing to any window. The one thing a repeat can meet is a
verdict the scorer reached since (a tunnel found in its zone covers every query there),
so any violation the observer finds empties this (``clear``).

REPLAY_S is a minute, from the judgement, not from the last repeat: a question asked
again and again is judged at most once a minute, so the scorer still hears of it that
often (its memory of names asked again, ``tunnel.scorer``'s ``Seen``, and its zone's
place among those kept are refreshed). What that costs: a zone of more names than its
own ``Seen`` holds (170-340) counts a forgotten one as new when it is judged again, now
once a minute, not at nearly every repeat, so a verdict that rests on those re-counts
alone comes later from this layer (the inline scorer sees every repeat that leaves, as
a TTL 0 answer is not cached); the evidence of a verdict counts the queries this layer
scored, not its replays. The resolver's own replay skips the scorer while its cache
entry lives (the answer's TTL, at most ``dns.ttl_max``): longer or shorter than a minute.
A second was too short for what egressd serves: a sandbox that asks its few names about
once a second each (5 qps over 4 names, ``bench_egressd``'s hits) had nearly every
repeat judged again, and at 1,000 sandboxes the observer spent 68-69% of a CPU
(3,989-4,069 qps), and 57% with a minute (4,210 qps): 170 -> 135 us a query.

Keys come from ``datapath.nflog_wire.udp4_payload`` of the copied IP packet, for lookup
and for keeping alike, and only a query that is exactly what was judged is kept: nothing
but an unfragmented IPv4 UDP query can match one. Bounded; emptied when full. Pure: ``now``
is passed in. Compiled by mypyc (``observer.native``), as ``sift`` that asks it.
"""

from __future__ import annotations

from typing import Final

from egress.datapath.nflog_wire import udp4_payload

REPLAY_S: Final = 60.0
REPLAY_MAX: Final = 4096
REPLAY_MAX_QUERY: Final = 512


class QueryReplays:
    def __init__(self) -> None:
        self._until: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self._until)

    def allowed(self, packet: bytes, now: float) -> bool:
        """Is the IP packet ``packet`` a repeat of a query allowed within REPLAY_S?"""
        dns = udp4_payload(packet)
        if dns is None:
            return False
        until = self._until.get(dns[2:])
        return until is not None and until > now

    def remember(self, packet: bytes, judged: bytes, now: float) -> None:
        """``judged`` (the DNS message parsed out of ``packet``) was allowed at ``now``."""
        dns = udp4_payload(packet)
        if dns is None or dns != judged or len(dns) > REPLAY_MAX_QUERY:
            return
        if len(self._until) >= REPLAY_MAX:
            self._until.clear()  # a client varying its bytes only slows the observer
        self._until[bytes(dns[2:])] = now + REPLAY_S

    def clear(self) -> None:
        self._until.clear()
