"""What the observer deals with straight from a datagram's copies, without events.

The NFLOG listener hands the observer each datagram's copies (``kernel.nflog``'s
``sift`` hook) before it makes events of them. The leading ones whose bytes say all there
is are dealt with here: repeats of a query allowed within the last minute
(``replays.QueryReplays``), and answers over UDP, whose bindings ``answers.Answers``
keeps by their bytes. Compiled by mypyc (``observer.native``): at cache hits these are
nearly every copy the observer reads, two a query.
"""

from __future__ import annotations

from typing import Final

from egress.datapath import constants as c
from egress.datapath.nflog_wire import Copies, udp4_payload
from egress.observer.answers import Answers
from egress.observer.replays import QueryReplays

DNS_PREFIX: Final = c.DNS_LOG_PREFIX.encode() + b"\0"
ANSWER_PREFIX: Final = c.ANSWER_LOG_PREFIX.encode() + b"\0"


def sift(
    copies: Copies,
    queries: QueryReplays,
    answers: Answers,
    now: float,
    wall: float,
) -> int:
    """How many of ``copies`` (one datagram's, in order, as ``nflog_wire.walk`` finds
    them), from the first, were dealt with: it stops at the first that must be an event (a query not
    judged allowed within the last minute, anything but a DNS query or a UDP answer), so
    nothing behind it is acted on first. ``now`` is the monotonic clock, ``wall`` the
    wall clock (the bindings' ends), each read once for the datagram."""
    for i in range(len(copies)):
        copy = copies[i]
        prefix = copy[3]
        if prefix == DNS_PREFIX:
            if not queries.allowed(copy[4], now):
                return i
        elif prefix == ANSWER_PREFIX:
            dns = udp4_payload(copy[4])
            if dns is None:
                return i
            answers.learn(dns, wall)
        else:
            return i
    return len(copies)
