"""The observer's replays of allowed queries (observer.replays): what a repeat may skip."""

from __future__ import annotations

import ipaddress
import time
from types import SimpleNamespace

from dnslib import QTYPE, RR, A, DNSRecord
from test_packet import ipv4, tcp, udp

from egress.datapath import constants as c
from egress.datapath.packet import parse_ip_packet
from egress.kernel.nflog import NflogEvent
from egress.observer.flows import FlowWatch
from egress.observer.layer import Observer
from egress.observer.replays import REPLAY_MAX, REPLAY_S, QueryReplays
from egress.policy import parse_policy
from egress.policy.matcher import Matcher

QUERY = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07allowed\x04test\x00\x00\x01\x00\x01"


def packet(dns: bytes, sport: int = 40000) -> bytes:
    return ipv4(17, udp(sport, 53, dns))


def test_a_repeat_with_another_id_and_port_is_allowed_for_a_minute() -> None:
    r = QueryReplays()
    r.remember(packet(QUERY), QUERY, now=10.0)
    repeat = packet(b"\xab\xcd" + QUERY[2:], sport=40001)
    assert r.allowed(repeat, 10.0 + REPLAY_S - 0.01)
    assert not r.allowed(repeat, 10.0 + REPLAY_S)
    other = QUERY[:-3] + b"\x1c\x00\x01"  # AAAA: another question
    assert not r.allowed(packet(other), 10.5)


def test_a_name_asked_about_once_a_second_is_judged_once_a_minute() -> None:
    """What egressd's sandboxes ask: a few names, each about once a second (5 qps over 4
    names). Each repeat within the minute after a judgement is replayed; with a replay
    of one second, most of them were judged again, and so parsed and scored."""
    r = QueryReplays()
    judged = []
    for at in (0.0, 0.9, 2.1, 3.4, 7.0, 30.0, 59.9, 60.0, 61.3, 119.9, 120.0):
        dns = int(at * 10).to_bytes(2, "big") + QUERY[2:]  # another ID each time
        if not r.allowed(packet(dns), at):
            judged.append(at)
            r.remember(packet(dns), dns, at)
    assert judged == [0.0, 60.0, 120.0]


def test_only_what_was_judged_is_kept() -> None:
    r = QueryReplays()
    r.remember(packet(QUERY), QUERY[:-1], now=0.0)  # not what the packet carries
    r.remember(ipv4(6, tcp(40000, 53, data=b"\x00\x1d" + QUERY)), QUERY, now=0.0)
    r.remember(ipv4(17, udp(40000, 53, QUERY), frag=0x2000), QUERY, now=0.0)
    assert len(r) == 0
    # a TCP segment whose bytes after its first two are a UDP query's: never a key
    assert not r.allowed(packet(QUERY), 0.5)
    long = QUERY + b"\0" * 600
    r.remember(packet(long), long, now=0.0)
    assert len(r) == 0


def test_bounded_and_cleared() -> None:
    r = QueryReplays()
    for i in range(REPLAY_MAX + 1):
        q = i.to_bytes(4, "big") + QUERY[4:]
        r.remember(packet(q), q, now=0.0)
    assert len(r) == 1  # emptied when full, then the newest kept
    r.clear()
    assert not r.allowed(packet(QUERY), 0.0)


POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: t}
spec:
  dns: {upstreams: ["192.0.2.53"], allow: [allowed.test]}
  connect: {ports: [443]}
"""


def test_the_observer_deals_with_repeats_and_answers_up_to_the_first_copy_to_judge() -> None:
    """``Observer._sift``, given one datagram's copies: the first ones it deals with
    itself (a repeat of an allowed query, an answer, whose names it binds); it stops at
    the first that must be an event, here a query it has not judged: what follows waits."""
    policy, _ = parse_policy(POLICY, "t.yaml")
    observer = object.__new__(Observer)  # the two parts _sift uses, no netns or journal
    observer.queries = QueryReplays()
    observer.flows = FlowWatch(policy, Matcher(policy), None)
    observer.queries.remember(packet(QUERY), QUERY, time.monotonic())

    def answer(ip: str) -> bytes:
        reply = DNSRecord.parse(QUERY).reply()
        reply.add_answer(RR("allowed.test", QTYPE.A, rdata=A(ip), ttl=60))
        return ipv4(17, udp(53, 40000, reply.pack()))

    def bound(ip: str) -> tuple[str, ...]:
        return observer.flows.bindings.names(ipaddress.ip_address(ip), time.time())

    other = QUERY[:-3] + b"\x1c\x00\x01"  # AAAA: not judged yet
    dns, answers = c.DNS_LOG_PREFIX.encode() + b"\0", c.ANSWER_LOG_PREFIX.encode() + b"\0"
    copies = [(0, 0, 0, dns, packet(QUERY)), (0, 0, 0, answers, answer("203.0.113.7")),
              (0, 0, 0, dns, packet(other)), (0, 0, 0, answers, answer("203.0.113.8")),
              (0, 0, 0, dns, packet(QUERY))]  # fmt: skip
    assert observer._sift(copies) == 2
    assert "allowed.test" in bound("203.0.113.7")
    assert not bound("203.0.113.8")  # behind the unjudged query: its turn comes after it
    assert observer._sift(copies[4:]) == 1  # the repeat, in a datagram of its own
    assert observer._sift([(0, 0, 0, b"egress blocked_connect\0", packet(QUERY))]) == 0


def test_a_drain_judges_no_repeat_behind_a_copy_to_judge_but_after_a_verdict_it_does() -> None:
    """Copies read in one drain behind one that must be judged (a query not judged yet)
    come as events, in order. A repeat among them of a query allowed within the minute
    is not judged again: the same verdict (``replays``); a busy observer reads many at
    once, and judging each again made it slower the further behind it fell. After a
    violation it is judged: the verdict (a tunnel's zone) may cover it now."""
    policy, _ = parse_policy(POLICY, "t.yaml")
    other = QUERY[:-3] + b"\x1c\x00\x01"  # AAAA: not judged yet

    def event(dns: bytes, prefix: str = c.DNS_LOG_PREFIX) -> NflogEvent:
        raw = packet(dns)
        parsed = parse_ip_packet(raw)
        assert parsed is not None
        return NflogEvent(c.OBSERVER_GROUP, prefix, raw, 1234, 1234, 4, 0x0800,
                          time.time(), parsed.flow(), parsed)  # fmt: skip

    def drained(events: list[NflogEvent], verdict_on_other: object = None,
                allowed_at: float = 0.0) -> list[tuple[str, bytes]]:  # fmt: skip
        observer = object.__new__(Observer)  # the parts _drain uses, no netns or journal
        observer.queries = QueryReplays()
        observer.flows = FlowWatch(policy, Matcher(policy), None)
        observer.queries.remember(packet(QUERY), QUERY, time.monotonic() - allowed_at)
        judged: list[tuple[str, bytes]] = []
        acted: list[object] = []

        def judge(e: NflogEvent) -> object:
            assert e.packet is not None
            judged.append((e.prefix, e.packet.payload))
            return verdict_on_other if e.packet.payload == other else None

        observer.judge = judge  # type: ignore[method-assign]
        observer._act = acted.append  # type: ignore[method-assign]
        observer.listener = SimpleNamespace(read_events=lambda _max: events)  # type: ignore[assignment]
        observer._drain()
        assert acted == ([] if verdict_on_other is None else [verdict_on_other])
        return judged

    dns = c.DNS_LOG_PREFIX
    behind = [event(other), event(QUERY), event(QUERY)]
    assert drained(behind) == [(dns, other)]
    found = object()
    assert drained(behind, found) == [(dns, other), (dns, QUERY)]  # emptied, then kept
    # Only a query's own copy: a drop carrying an allowed query's bytes is judged.
    dropped = "egress foreign_dns"
    assert drained([event(other), event(QUERY, dropped)]) == [(dns, other), (dropped, QUERY)]
    # A query allowed longer ago than REPLAY_S is judged again.
    assert drained(behind, allowed_at=REPLAY_S + 0.5) == [(dns, other), (dns, QUERY)]
