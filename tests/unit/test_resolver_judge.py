"""The one verdict on a query, and both layers giving it: no root, no sockets.

The inline layer's core and the observer layer each judge every query with
``egress.resolver.judge``; here both are fed the same queries (the observer as the packet
the kernel would copy to it) and must journal the same violation, field for field.
"""

from __future__ import annotations

import random

import pytest
from dnslib import DNSRecord

from egress.datapath import constants as c
from egress.datapath.packet import Packet
from egress.kernel.nflog import NflogEvent
from egress.model import Flow, ViolationClass
from egress.observer.layer import verdict_on
from egress.policy import parse_policy
from egress.policy.matcher import Matcher
from egress.resolver import wire
from egress.resolver.actions import Report
from egress.resolver.core import ResolverCore
from egress.resolver.judge import judge
from egress.tunnel import scorer_for

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: t}
spec:
  dns:
    upstreams: ["192.0.2.53"]
    allow:
      - allowed.test
      - "*.zone.test"
      - {name: api.test, types: [A]}
"""


def policy():  # type: ignore[no-untyped-def]
    return parse_policy(POLICY, "t.yaml")[0]


def raw(name: str, qtype: str = "A", qclass: int = 1) -> bytes:
    q = DNSRecord.question(name, qtype)
    q.q.qclass = qclass
    return bytes(q.pack())


def binary(zone_label: bytes) -> bytes:
    """A query for <zone_label>.zone.test: labels a hostname cannot have."""
    head = bytes(DNSRecord.question("x.zone.test").pack()[:12])
    name = bytes([len(zone_label)]) + zone_label + b"\x04zone\x04test\x00"
    return head + name + b"\x00\x01\x00\x01"


CASES = [
    (raw("allowed.test"), None, ""),
    (raw("denied.test"), ViolationClass.DENIED_NAME, "query denied.test A"),
    (raw("api.test", "TXT"), ViolationClass.DENIED_TYPE, "query api.test TXT"),
    (raw("allowed.test", "A", 3), ViolationClass.DENIED_TYPE, "query allowed.test A (class 3)"),
    (binary(b"a\x00b"), ViolationClass.TUNNEL, "non-hostname bytes"),
    (raw("a.b.elsewhere.test").replace(b"\x01a", b"\x01\xff"), ViolationClass.DENIED_NAME,
     "(not a hostname)"),
]  # fmt: skip


@pytest.mark.parametrize(("data", "cls", "detail"), CASES)
def test_the_verdict_names_class_rule_and_detail(
    data: bytes, cls: ViolationClass | None, detail: str
) -> None:
    p = policy()
    verdict = judge(wire.parse_query(data), Matcher(p), None)
    assert verdict.cls is cls
    assert detail in verdict.detail
    if cls is None:
        assert verdict.rule is not None and verdict.rule.pattern.text == "allowed.test"


def test_a_tunnel_finding_comes_from_the_scorer_only_for_allowed_names() -> None:
    p = policy()
    calls: list[str] = []

    class Scorer:
        def can_defer(self, name: str, qtype: int) -> bool:
            return False

        def observe_query(self, name: str, qtype: int) -> object:
            calls.append(name)
            return type("F", (), {"describe": lambda self: "too much entropy"})()

        def observe_response(self, name: str, rcode: int) -> None:
            pass

    m = Matcher(p)
    assert judge(wire.parse_query(raw("denied.test")), m, Scorer()).cls is (
        ViolationClass.DENIED_NAME
    )
    found = judge(wire.parse_query(raw("q1.zone.test")), m, Scorer())
    assert found.cls is ViolationClass.TUNNEL and found.reason == "spec.tunnel"
    assert found.detail == "query q1.zone.test A: too much entropy"
    assert calls == ["q1.zone.test"]  # a denied query carries nothing out: not scored


def event(data: bytes, uid: int = 1234) -> NflogEvent:
    flow = Flow("udp", "10.200.0.2", c.RESOLVER4, 40000, 53)
    packet = Packet(4, "udp", "10.200.0.2", c.RESOLVER4, 40000, 53, payload=data)
    return NflogEvent(c.OBSERVER_GROUP, c.DNS_LOG_PREFIX, b"", uid, uid, 4, 0x0800, 7.0,
                      flow, packet)  # fmt: skip


def tunnel_names(n: int) -> list[bytes]:
    rng = random.Random(3)
    return [
        raw("".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(40))
            + f".x{i}.zone.test")
        for i in range(n)
    ]  # fmt: skip


def test_both_layers_journal_the_same_violation_for_every_query() -> None:
    p = policy()
    core = ResolverCore(
        p, 1, random.Random(1).getrandbits, scorer=scorer_for(p.tunnel, lambda: 7.0)
    )
    matcher, scorer = Matcher(p), scorer_for(p.tunnel, lambda: 7.0)
    queries = [data for data, _, _ in CASES] + tunnel_names(200)
    verdicts = 0
    for data in queries:
        inline = [
            a.violation for a in core.on_query(data, "c", False, 7.0) if isinstance(a, Report)
        ]
        observed = verdict_on(event(data), p, matcher, scorer)
        if observed is None:
            assert inline == []
            continue
        [v] = inline
        verdicts += 1
        for key in ("cls", "rule", "detail", "action", "qname", "qtype", "at"):
            assert getattr(v, key) == getattr(observed, key), (key, v, observed)
        assert (v.layer, observed.layer) == ("inline", "observer")
        assert observed.uid == 1234
    assert verdicts > len(CASES)  # the scorer found the tunnel in both layers


def test_a_logged_drop_is_its_class_and_other_packets_say_nothing() -> None:
    p = policy()
    drop = event(b"")
    drop = NflogEvent(drop.group, c.DROP_LOG_PREFIX + "blocked_connect", b"", 1000, 1000, 4,
                      0x0800, 7.0, Flow("tcp", "10.200.0.2", "192.0.2.9", 4000, 443))  # fmt: skip
    v = verdict_on(drop, p, Matcher(p), None)
    assert v is not None and v.cls is ViolationClass.BLOCKED_CONNECT and v.uid == 1000
    assert verdict_on(event(b"\x00\x01garbage"), p, Matcher(p), None) is None


def test_a_copy_holding_more_than_one_plain_query_is_a_tunnel_to_the_observer() -> None:
    """UDP GSO: [allowed, denied] sent at once reach the rule as one packet that parses
    as its first query, while the resolver reads both. The observer cannot judge the rest
    of such a copy, so the copy itself is the violation."""
    p = policy()
    matcher = Matcher(p)
    allowed, denied = raw("allowed.test"), raw("denied.test")
    with_opt = wire.build_query(7, "allowed.test", 1)
    for plain in (allowed, with_opt):
        assert wire.one_plain_query(plain, wire.parse_query(plain))
        assert verdict_on(event(plain), p, matcher, None) is None
    smuggled = [
        allowed + denied,  # two queries, no OPT
        with_opt + denied,  # after a whole OPT record
        with_opt[:10] + b"\x00\x02" + with_opt[12:] + denied,  # "two records": the rest
        with_opt[:-2] + b"\x00\x04",  # an OPT whose data the packet does not hold
        allowed + b"\x00",  # one stray byte
    ]
    for data in smuggled:
        assert not wire.one_plain_query(data, wire.parse_query(data))
        v = verdict_on(event(data), p, matcher, None)
        assert v is not None and v.cls is ViolationClass.TUNNEL, data
        assert "more than one DNS message in one UDP packet" in v.detail
