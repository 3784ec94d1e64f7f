"""The resolver core, driven by hand: no sockets, an upstream made of dnslib replies."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from dnslib import AAAA, CNAME, EDNS0, QTYPE, RR, SOA, TXT, A, DNSRecord

from egress.model import ViolationClass
from egress.policy import parse_policy
from egress.resolver import wire
from egress.resolver.actions import AllowThenReply, Forward, Reply, Report, Revoke
from egress.resolver.core import ResolverCore

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {{name: t}}
spec:
  mode: {mode}
  dns:
    upstreams: ["192.0.2.53", "192.0.2.54"]
    ttl: {{min: 5s, max: 1h}}
    denied_response: {denied}
    allow:
      - allowed.test
      - alias.test
      - "*.cdn.test"
      - {{name: api.test, types: [A], ports: [443]}}
"""


def acked(c: ResolverCore, token: int, data: bytes, now: float) -> list:
    """The shell's side of a successful set update: every add acked, on time."""
    actions = c.on_upstream_reply(token, data, now)
    for a in actions:
        if isinstance(a, AllowThenReply):
            c.on_allowed(a.token, len(a.adds), now)
    return actions


def core(mode: str = "enforce", denied: str = "nxdomain") -> ResolverCore:
    policy, _ = parse_policy(POLICY.format(mode=mode, denied=denied), "t.yaml")
    rng = random.Random(7)
    return ResolverCore(policy, n_upstreams=2, randbits=rng.getrandbits)


def query(name: str, qtype: str = "A", qid: int = 4242, edns: bool = False) -> bytes:
    q = DNSRecord.question(name, qtype)
    q.header.id = qid
    if edns:
        q.add_ar(EDNS0(udp_len=4096))
    return bytes(q.pack())


def upstream_answer(fwd: Forward, *records: RR, rcode: int = 0, auth: tuple[RR, ...] = ()) -> bytes:
    q = DNSRecord.parse(fwd.data)
    r = q.reply()
    r.header.rcode = rcode
    for rr in records:
        r.add_answer(rr)
    for rr in auth:
        r.add_auth(rr)
    return bytes(r.pack())


def only(actions: list, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def test_allowed_name_is_forwarded_with_our_own_id_case_and_edns() -> None:
    c = core()
    actions = c.on_query(query("AlLoWeD.TeSt.", edns=True, qid=99), "client", False, 0.0)
    [fwd] = only(actions, Forward)
    up = DNSRecord.parse(fwd.data)
    assert str(up.q.qname) == "allowed.test."
    assert up.header.id != 99
    [opt] = up.ar
    assert opt.rtype == QTYPE.OPT and opt.rdata == []  # no client options ride along


def test_answer_waits_for_the_set_update_and_carries_the_ip() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "client", False, 0.0)
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60)
    [act] = acked(c, fwd.token, upstream_answer(fwd, rr), 0.1)
    assert isinstance(act, AllowThenReply)
    assert act.update.elements4 == ("203.0.113.10 . tcp . 80", "203.0.113.10 . tcp . 443")
    assert act.update.timeout_s == 60
    client, data, fallback = act.replies[0]
    assert client == "client"
    assert DNSRecord.parse(data).header.id == 4242
    assert DNSRecord.parse(fallback).header.rcode == wire.SERVFAIL


def test_rule_ports_and_ttl_bounds() -> None:
    c = core()
    [fwd] = c.on_query(query("api.test"), "c", False, 0.0)
    rr = RR("api.test", QTYPE.A, rdata=A("203.0.113.11"), ttl=1)
    [act] = acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    assert act.update.elements4 == ("203.0.113.11 . tcp . 443",)
    assert act.update.timeout_s == 5  # clamped up to ttl.min


@pytest.mark.parametrize(
    ("name", "qtype", "cls"),
    [
        ("denied.test", "A", ViolationClass.DENIED_NAME),
        ("evil-allowed.test", "A", ViolationClass.DENIED_NAME),
        ("allowed.test.evil.test", "A", ViolationClass.DENIED_NAME),
        ("a.b.cdn.test", "A", ViolationClass.DENIED_NAME),
        ("allowed.test", "TXT", ViolationClass.DENIED_TYPE),
        ("allowed.test", "NULL", ViolationClass.DENIED_TYPE),
        ("allowed.test", "ANY", ViolationClass.DENIED_TYPE),
        ("api.test", "AAAA", ViolationClass.DENIED_TYPE),
    ],
)
def test_denied_queries_never_go_upstream(name: str, qtype: str, cls: ViolationClass) -> None:
    c = core()
    actions = c.on_query(query(name, qtype), "c", False, 0.0)
    assert not only(actions, Forward)
    [report] = only(actions, Report)
    assert report.violation.cls is cls
    assert report.violation.layer == "inline"
    [reply] = only(actions, Reply)
    expected = wire.NXDOMAIN if cls is ViolationClass.DENIED_NAME else wire.REFUSED
    assert DNSRecord.parse(reply.data).header.rcode == expected


@pytest.mark.parametrize(
    ("name", "qtype", "text"),
    [
        ("denied.test", "A", "egress: name not allowed by policy t (denied_name)"),
        ("allowed.test", "TXT", "egress: record type not allowed by policy t (denied_type)"),
    ],
)
def test_a_refusal_says_egress_refused_it_and_why(name: str, qtype: str, text: str) -> None:
    # RFC 8914 Extended DNS Error 15 (Blocked): what `dig` shows an agent. Only a client
    # that sent EDNS gets an OPT record back (RFC 6891).
    c = core()
    [reply] = only(c.on_query(query(name, qtype, edns=True), "c", False, 0.0), Reply)
    opt = [rr for rr in DNSRecord.parse(reply.data).ar if rr.rtype == QTYPE.OPT]
    assert len(opt) == 1
    [option] = opt[0].rdata
    assert option.code == wire.EDE_OPTION
    assert option.data == wire.EDE_BLOCKED.to_bytes(2) + text.encode()
    [plain] = only(c.on_query(query(name, qtype), "c", False, 0.0), Reply)
    assert DNSRecord.parse(plain.data).ar == []


def test_an_ede_text_is_cut_at_a_character_boundary() -> None:
    option = wire.ede_option(wire.EDE_BLOCKED, "é" * 150)  # 300 bytes of UTF-8
    assert len(option) == 6 + wire.EDE_MAX_TEXT and option[6:].decode("utf-8") == "é" * 100


def test_a_withheld_answer_says_why_too_also_from_the_cache() -> None:
    c = core()
    [fwd] = c.on_query(query("alias.test", edns=True), "c", False, 0.0)
    records = (
        RR("alias.test", QTYPE.CNAME, rdata=CNAME("denied.test"), ttl=60),
        RR("denied.test", QTYPE.A, rdata=A("203.0.113.12"), ttl=60),
    )
    text = b"egress: answer leads to a name not allowed by policy t (denied_name)"
    [reply] = only(acked(c, fwd.token, upstream_answer(fwd, *records), 0.0), Reply)
    again = only(c.on_query(query("alias.test", edns=True), "c", False, 1.0), Reply)
    plain = only(c.on_query(query("alias.test"), "c", False, 2.0), Reply)
    for got in (reply, *again):
        [opt] = [rr for rr in DNSRecord.parse(got.data).ar if rr.rtype == QTYPE.OPT]
        assert opt.rdata[0].data == wire.EDE_BLOCKED.to_bytes(2) + text
    assert [DNSRecord.parse(r.data).ar for r in plain] == [[]]


def test_denied_response_refused_is_configurable() -> None:
    c = core(denied="refused")
    [_, reply] = c.on_query(query("denied.test"), "c", False, 0.0)
    assert DNSRecord.parse(reply.data).header.rcode == wire.REFUSED


def test_cname_to_a_denied_name_is_refused_whole() -> None:
    c = core()
    [fwd] = c.on_query(query("alias.test"), "c", False, 0.0)
    records = (
        RR("alias.test", QTYPE.CNAME, rdata=CNAME("denied.test"), ttl=60),
        RR("denied.test", QTYPE.A, rdata=A("203.0.113.12"), ttl=60),
    )
    actions = acked(c, fwd.token, upstream_answer(fwd, *records), 0.0)
    assert not only(actions, AllowThenReply)
    [report] = only(actions, Report)
    assert report.violation.cls is ViolationClass.DENIED_NAME
    [reply] = only(actions, Reply)
    assert DNSRecord.parse(reply.data).header.rcode == wire.NXDOMAIN


def test_cname_to_an_allowed_name_is_answered() -> None:
    c = core()
    [fwd] = c.on_query(query("alias.test"), "c", False, 0.0)
    records = (
        RR("alias.test", QTYPE.CNAME, rdata=CNAME("allowed.test"), ttl=60),
        RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60),
        RR("elsewhere.test", QTYPE.A, rdata=A("203.0.113.66"), ttl=60),  # off the chain
    )
    [act] = acked(c, fwd.token, upstream_answer(fwd, *records), 0.0)
    assert act.update.elements4[0].startswith("203.0.113.10 ")
    answer = DNSRecord.parse(act.replies[0][1])
    assert [str(r.rdata) for r in answer.rr] == ["allowed.test.", "203.0.113.10"]


@pytest.mark.parametrize(
    ("qtype", "rdata"),
    [
        ("A", A("169.254.169.254")),
        ("A", A("127.0.0.1")),
        ("A", A("10.1.2.3")),
        ("AAAA", AAAA("fe80::1")),
        ("AAAA", AAAA("::ffff:7f00:1")),
    ],
)
def test_rebinding_answers_are_dropped(qtype: str, rdata: object) -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test", qtype), "c", False, 0.0)
    rr = RR("allowed.test", getattr(QTYPE, qtype), rdata=rdata, ttl=60)
    actions = acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    assert not only(actions, AllowThenReply)
    [report] = only(actions, Report)
    assert report.violation.cls is ViolationClass.REBINDING
    [reply] = only(actions, Reply)
    assert DNSRecord.parse(reply.data).rr == []


def test_documentation_ranges_are_not_rebinding() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test", "AAAA"), "c", False, 0.0)
    rr = RR("allowed.test", QTYPE.AAAA, rdata=AAAA("2001:db8::10"), ttl=60)
    [act] = acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    assert act.update.elements6 == ("2001:db8::10 . tcp . 80", "2001:db8::10 . tcp . 443")


def test_records_of_unasked_or_unallowed_types_are_removed() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    records = (
        RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60),
        RR("allowed.test", QTYPE.TXT, rdata=TXT("smuggled"), ttl=60),
    )
    [act] = acked(c, fwd.token, upstream_answer(fwd, *records), 0.0)
    assert [r.rtype for r in DNSRecord.parse(act.replies[0][1]).rr] == [QTYPE.A]


def test_cache_hit_patches_id_ttl_and_question_case() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60)
    acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    [hit] = c.on_query(query("ALLOWED.test", qid=7, edns=True), "c2", False, 10.0)
    assert isinstance(hit, Reply)
    msg = DNSRecord.parse(hit.data)
    assert msg.header.id == 7
    assert str(msg.q.qname) == "ALLOWED.test."
    assert msg.rr[0].ttl == 50
    assert msg.ar and msg.ar[0].rtype == QTYPE.OPT
    assert c.stats["forwarded"] == 1


def test_cache_hit_refreshes_the_set_when_it_would_lapse_first() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=600)
    acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    [entry] = c.cache._entries.values()
    entry.allowed_until = 100.0  # e.g. the element was removed or set with a shorter timeout
    [hit] = c.on_query(query("allowed.test"), "c", False, 50.0)
    assert isinstance(hit, AllowThenReply)
    assert hit.update.timeout_s == 550
    # Until the kernel acks the refresh, a hit asks for it again.
    assert isinstance(c.on_query(query("allowed.test"), "c", False, 55.0)[0], AllowThenReply)
    c.on_allowed(hit.token, len(hit.adds), 55.0)
    [again] = c.on_query(query("allowed.test"), "c", False, 60.0)
    assert isinstance(again, Reply)


def test_negative_answers_are_cached_for_the_soa_minimum() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test", "AAAA"), "c", False, 0.0)
    soa = RR("test", QTYPE.SOA, rdata=SOA("ns.test", "h.test", (1, 2, 3, 4, 30)), ttl=300)
    acked(c, fwd.token, upstream_answer(fwd, rcode=3, auth=(soa,)), 0.0)
    [hit] = c.on_query(query("allowed.test", "AAAA"), "c", False, 29.0)
    assert DNSRecord.parse(hit.data).header.rcode == wire.NXDOMAIN
    assert only(c.on_query(query("allowed.test", "AAAA"), "c", False, 31.0), Forward)


def test_identical_questions_in_flight_share_one_upstream_query() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test", qid=1), "a", False, 0.0)
    assert c.on_query(query("allowed.test", qid=2), "b", False, 0.0) == []
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60)
    [act] = acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    assert [(cl, DNSRecord.parse(d).header.id) for cl, d, _ in act.replies] == [("a", 1), ("b", 2)]


def test_upstream_failover_then_servfail() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    [second] = c.on_upstream_failure(fwd.token, 2.0)
    assert isinstance(second, Forward) and second.upstream == 1
    [reply] = c.on_upstream_failure(fwd.token, 4.0)
    assert DNSRecord.parse(reply.data).header.rcode == wire.SERVFAIL
    assert c.pending == {} and c.inflight == {}


def test_truncated_upstream_answer_is_retried_over_tcp() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    r = DNSRecord.parse(upstream_answer(fwd))
    r.header.tc = 1
    [retry] = acked(c, fwd.token, bytes(r.pack()), 0.0)
    assert isinstance(retry, Forward) and retry.tcp


def test_spoofed_reply_with_another_id_is_ignored() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    r = DNSRecord.parse(upstream_answer(fwd))
    r.header.id ^= 0xFFFF
    assert acked(c, fwd.token, bytes(r.pack()), 0.0) == []
    assert fwd.token in c.pending


def test_udp_answer_too_big_for_the_client_is_truncated() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    records = [RR("allowed.test", QTYPE.A, rdata=A(f"203.0.113.{i}"), ttl=60) for i in range(1, 60)]
    [act] = acked(c, fwd.token, upstream_answer(fwd, *records), 0.0)
    msg = DNSRecord.parse(act.replies[0][1])
    assert msg.header.tc == 1 and msg.rr == []
    [tcp] = c.on_query(query("allowed.test"), "c", True, 0.0)
    assert len(DNSRecord.parse(tcp.data).rr) == 59


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00" * 5,
        bytes(DNSRecord.question("allowed.test").reply().pack()),  # a response
        bytes.fromhex("1234010000020000000000000774657374000001000107746573740000010001"),
        bytes.fromhex("12340100000100000000000007616c6c6f776564"),  # cut short
        bytes.fromhex("1234010000010000000000000c0c0000010001"),  # pointer in question
        bytes.fromhex("1234290000010000000000000474657374000001000100"),  # opcode UPDATE
    ],
)
def test_malformed_packets_never_go_upstream(data: bytes) -> None:
    c = core()
    actions = c.on_query(data, "c", False, 0.0)
    assert not only(actions, Forward)
    for reply in only(actions, Reply):
        assert DNSRecord.parse(reply.data).header.rcode in (wire.FORMERR, wire.NOTIMP)


def test_audit_mode_forwards_denied_names_and_reports_them() -> None:
    c = core(mode="audit")
    actions = c.on_query(query("denied.test"), "c", False, 0.0)
    [report] = only(actions, Report)
    assert report.violation.cls is ViolationClass.DENIED_NAME
    [fwd] = only(actions, Forward)
    rr = RR("denied.test", QTYPE.A, rdata=A("127.0.0.1"), ttl=60)
    [act] = acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    assert isinstance(act, AllowThenReply)  # answered as a plain forwarder would


def _cached(c: ResolverCore, name: str = "allowed.test", ttl: int = 60) -> None:
    [fwd] = c.on_query(query(name), "c", False, 0.0)
    rr = RR(name, QTYPE.A, rdata=A("203.0.113.10"), ttl=ttl)
    acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)


def test_a_repeated_udp_query_is_replayed_byte_for_byte_but_its_id() -> None:
    c = core()
    _cached(c)
    first = bytes(query("AlLoWeD.test", qid=1, edns=True))
    assert c.replay(first, 10.2) is None  # not seen yet: the full path, which remembers it
    [hit] = c.on_query(first, "c", False, 10.2)
    again = bytes(query("AlLoWeD.test", qid=2, edns=True))
    replayed = c.replay(again, 10.9)
    assert replayed is not None and replayed[:2] == again[:2]
    assert replayed[2:] == hit.data[2:]
    assert DNSRecord.parse(replayed).rr[0].ttl == 50
    assert c.stats["cache_hits"] == 2 and c.stats["queries"] == 3


def test_a_replay_ages_its_ttls_as_the_cache_would_until_the_entry_expires() -> None:
    c = core()
    _cached(c, ttl=5)  # stored at 0.0, expires at 5.0
    first = bytes(query("allowed.test", qid=1, edns=True))
    c.on_query(first, "c", False, 0.3)
    for now in (0.9, 1.0, 1.7, 2.0, 3.5, 4.99):
        again = bytes(query("allowed.test", qid=7, edns=True))
        replayed = c.replay(again, now)
        [fresh] = c.on_query(again, "c", False, now)  # what the full path renders now
        assert replayed == fresh.data, now
        assert DNSRecord.parse(replayed).rr[0].ttl == 5 - int(now)
    assert c.replay(first, 5.0) is None  # expired: on_query asks upstream again


def _replaying(ttl: int, at: float) -> tuple[ResolverCore, bytes]:
    """A core with allowed.test cached (at 0.0) and a query for it answered from the cache
    at ``at``: remembered, so replayed."""
    c = core()
    _cached(c, ttl=ttl)
    q = bytes(query("allowed.test"))
    c.on_query(q, "c", False, at)
    assert c.replay(q, at + 0.5) is not None
    return c, q


def test_a_replay_ends_with_its_cache_entry() -> None:
    c, q = _replaying(ttl=60, at=1.0)
    [(key, entry)] = c.cache._entries.items()
    c.cache.put(key, replace(entry))  # answered anew: its own replay, once answered
    assert c.replay(q, 1.6) is None
    c.on_query(q, "c", False, 1.7)
    assert c.replay(q, 1.8) is not None
    c.cache.clear()  # evicted: on_query asks upstream again, and so must a replay
    assert c.replay(q, 1.9) is None


def test_replays_keep_a_hot_name_at_the_caches_fresh_end() -> None:
    policy, _ = parse_policy(POLICY.format(mode="enforce", denied="nxdomain"), "t.yaml")
    c = ResolverCore(policy, 2, random.Random(7).getrandbits, cache_size=3)
    _cached(c, "allowed.test", ttl=3600)
    hot = bytes(query("allowed.test"))
    c.on_query(hot, "c", False, 0.5)
    for second in range(1, 12):  # a new name a second, the hot one replayed each second
        _cached(c, f"n{second}.cdn.test", ttl=3600)
        assert c.replay(hot, second + 0.5) is not None, second


def test_an_answer_the_sets_may_need_refreshing_for_is_never_replayed() -> None:
    c = core()
    _cached(c, ttl=600)
    [entry] = c.cache._entries.values()
    entry.allowed_until = entry.expires_at - 0.5  # the kernel forgets half a second early
    q = bytes(query("allowed.test"))
    # Early in a second, the client's TTL still ends before the kernel's element does
    # (whole seconds), and on_query answers; later in one, it refreshes the sets first.
    [plain] = c.on_query(q, "c", False, 10.3)
    assert isinstance(plain, Reply)
    assert c.replay(q, 10.9) is None  # not remembered: on_query would refresh by now
    [refresh] = c.on_query(q, "c", False, 10.9)
    assert isinstance(refresh, AllowThenReply)


def test_a_replay_is_not_aged_past_what_the_sets_allow() -> None:
    c, q = _replaying(ttl=600, at=10.3)
    [entry] = c.cache._entries.values()
    entry.allowed_until = entry.expires_at - 0.5  # whatever lowered it, the next second
    assert c.replay(q, 11.1) is None  # goes through on_query's refresh


def test_a_truncated_replay_is_replayed_as_it_was() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    rrs = [RR("allowed.test", QTYPE.A, rdata=A(f"203.0.113.{i}"), ttl=60) for i in range(1, 41)]
    acked(c, fwd.token, upstream_answer(fwd, *rrs), 0.0)
    q = bytes(query("allowed.test"))  # no EDNS: 512 bytes at most, 40 addresses do not fit
    [tc] = c.on_query(q, "c", False, 0.5)
    assert DNSRecord.parse(tc.data).header.tc
    assert c.replay(q, 3.2) == tc.data


def test_replays_end_with_the_policy_and_never_cover_tcp_or_other_bytes() -> None:
    c = core()
    _cached(c)
    q = bytes(query("allowed.test", qid=1))
    c.on_query(q, "c", True, 1.0)  # TCP: answered, not remembered
    assert c.replay(q, 1.0) is None
    c.on_query(q, "c", False, 1.0)
    assert c.replay(q, 1.5) is not None
    assert c.replay(q[:-1] + b"\x02", 1.5) is None  # class 2: other bytes, other question
    c.set_policy(c.policy)
    assert c.replay(q, 1.5) is None


def test_no_replay_while_the_sets_may_need_a_refresh() -> None:
    c = core()
    _cached(c, ttl=600)
    [entry] = c.cache._entries.values()
    entry.allowed_until = 100.0
    q = bytes(query("allowed.test"))
    [refresh] = c.on_query(q, "c", False, 50.0)
    assert isinstance(refresh, AllowThenReply)
    assert c.replay(q, 50.5) is None  # a refresh goes through the shell's set update
    c.on_allowed(refresh.token, len(refresh.adds), 50.5)
    [plain] = c.on_query(q, "c", False, 51.0)
    assert isinstance(plain, Reply) and c.replay(q, 51.5) is not None


@pytest.mark.parametrize("label", [b"a\x00b", b"x.y", b"\xff", b"*"])
def test_names_with_binary_labels_are_denied_and_never_forwarded(label: bytes) -> None:
    c = core()
    name = bytes([len(label)]) + label + b"\x04wild\x03cdn\x04test\x00"
    data = wire.HEADER.pack(9, wire.RD, 1, 0, 0, 0) + name + b"\x00\x01\x00\x01"
    actions = c.on_query(data, "c", False, 0.0)
    assert not only(actions, Forward)
    [report] = only(actions, Report)
    assert report.violation.cls is ViolationClass.DENIED_NAME


class FakeScorer:
    """Flags names under tunnel.cdn.test; records what it saw. ``defer``: what its
    ``can_defer`` says of every name (True of a tunnel's: a bound gone wrong)."""

    def __init__(self, defer: bool = False) -> None:
        self.queries: list[tuple[str, int]] = []
        self.responses: list[tuple[str, int]] = []
        self.defer = defer

    def can_defer(self, name: str, qtype: int) -> bool:
        return self.defer

    def observe_query(self, name: str, qtype: int) -> object | None:
        self.queries.append((name, qtype))
        return Verdict() if name.endswith("tunnel.cdn.test") else None

    def observe_response(self, name: str, rcode: int) -> None:
        self.responses.append((name, rcode))


class Verdict:
    def describe(self) -> str:
        return "DNS tunnel suspected under cdn.test"


def test_the_scorer_sees_allowed_misses_only_and_its_verdict_stops_the_query() -> None:
    c = core()
    scorer = FakeScorer()
    c.scorer = scorer  # type: ignore[assignment]
    assert only(c.on_query(query("denied.test"), "c", False, 0.0), Report)
    _cached(c)
    c.on_query(query("allowed.test"), "c", False, 1.0)  # a hit
    assert scorer.queries == [("allowed.test", 1)] and scorer.responses == [("allowed.test", 0)]
    actions = c.on_query(query("tunnel.cdn.test"), "c", False, 2.0)
    assert not only(actions, Forward)
    [report] = only(actions, Report)
    assert report.violation.cls is ViolationClass.TUNNEL
    assert "tunnel suspected" in report.violation.detail
    [reply] = only(actions, Reply)
    assert DNSRecord.parse(reply.data).header.rcode == wire.REFUSED


def test_a_query_the_scorer_clears_is_sent_first_and_scored_by_settle() -> None:
    c = core()
    scorer = FakeScorer(defer=True)
    c.scorer = scorer  # type: ignore[assignment]
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    assert isinstance(fwd, Forward) and scorer.queries == []  # not on the way out
    assert c.settle(0.0) == [] and scorer.queries == [("allowed.test", 1)]
    acked(c, fwd.token, upstream_answer(fwd, rcode=3), 0.0)
    assert scorer.responses == []  # the rcode waits for the answer to be sent
    # Not settled by the shell: the next query settles first, in order, then is judged.
    c.on_query(query("b.cdn.test"), "c", False, 1.0)
    assert scorer.responses == [("allowed.test", 3)] and c.later
    assert c.settle(1.0) == [] and scorer.queries[-1] == ("b.cdn.test", 1)
    # A verdict found so is reported after the query's own actions: its send goes first.
    c.on_query(query("tunnel.cdn.test"), "c", False, 2.0)
    actions = c.on_query(query("c.cdn.test"), "c", False, 2.0)
    assert [type(a) for a in actions] == [Forward, Report]


def test_a_cleared_query_that_makes_a_verdict_is_reported_and_its_answer_refused() -> None:
    """The bound is sound, so this is a bug's path: still no answer, no address allowed,
    and the name not asked again (over TCP, or of the next upstream)."""
    for ending in ("answer", "truncated", "timeout"):
        c = core()
        c.scorer = FakeScorer(defer=True)  # type: ignore[assignment]
        [fwd] = c.on_query(query("tunnel.cdn.test"), "c", False, 0.0)
        [report] = only(c.settle(0.0), Report)
        assert report.violation.cls is ViolationClass.TUNNEL
        if ending == "timeout":
            actions = c.on_upstream_failure(fwd.token, 0.0)
        else:
            answer = DNSRecord.parse(
                upstream_answer(fwd, RR("tunnel.cdn.test", rdata=A("203.0.113.9")))
            )
            answer.header.tc = ending == "truncated"
            actions = c.on_upstream_reply(fwd.token, bytes(answer.pack()), 0.0)
        assert not only(actions, Forward) and not only(actions, AllowThenReply), ending
        [reply] = only(actions, Reply)
        msg = DNSRecord.parse(reply.data)  # as if scored first (its EDE text: the query's)
        assert msg.header.rcode == wire.REFUSED and msg.rr == [], ending
        assert not c.pending


def test_a_cleared_query_counts_denied_once_its_verdict_is_found() -> None:
    c = core()
    c.scorer = FakeScorer(defer=True)  # type: ignore[assignment]
    c.on_query(query("tunnel.cdn.test"), "c", False, 0.0)
    assert (c.stats["allowed"], c.stats["denied"]) == (1, 0)
    c.settle(0.0)
    assert (c.stats["allowed"], c.stats["denied"]) == (0, 1)


def test_a_cleared_query_whose_scoring_raises_is_refused_and_the_rest_settled() -> None:
    class Broken(FakeScorer):
        def observe_query(self, name: str, qtype: int) -> object | None:
            if name == "broken.cdn.test":
                raise RuntimeError("a bug")
            return super().observe_query(name, qtype)

    c = core()
    scorer = Broken(defer=True)
    c.scorer = scorer  # type: ignore[assignment]
    [broken] = c.on_query(query("broken.cdn.test"), "c", False, 0.0)
    c.later.append((None, "x.cdn.test", 3, None))  # an answer's rcode, after it
    with pytest.raises(RuntimeError, match="a bug"):
        c.settle(0.0)
    assert scorer.responses == [("x.cdn.test", 3)]  # what came after it was settled
    actions = c.on_upstream_reply(broken.token, upstream_answer(broken), 0.0)
    [reply] = only(actions, Reply)
    assert DNSRecord.parse(reply.data).header.rcode == wire.SERVFAIL
    assert not only(actions, AllowThenReply)
    # Asked again, it is scored first (nothing is deferred any more): not sent.
    assert not c.deferring
    with pytest.raises(RuntimeError, match="a bug"):
        c.on_query(query("broken.cdn.test"), "c", False, 1.0)


@pytest.mark.parametrize("ending", ["answer", "timeout"])
def test_a_cleared_query_the_shell_did_not_settle_is_settled_before_its_answer(
    ending: str,
) -> None:
    """An exception between its send and the shell's settle: its answer (or its retry)
    settles first, and the verdict found then still withholds it."""
    c = core()
    c.scorer = FakeScorer(defer=True)  # type: ignore[assignment]
    [fwd] = c.on_query(query("tunnel.cdn.test"), "c", False, 0.0)
    if ending == "timeout":
        actions = c.on_upstream_failure(fwd.token, 0.0)
    else:
        rr = RR("tunnel.cdn.test", rdata=A("203.0.113.9"))
        actions = c.on_upstream_reply(fwd.token, upstream_answer(fwd, rr), 0.0)
    [report] = only(actions, Report)
    assert report.violation.cls is ViolationClass.TUNNEL
    assert not only(actions, AllowThenReply) and not only(actions, Forward)
    [reply] = only(actions, Reply)
    assert DNSRecord.parse(reply.data).header.rcode == wire.REFUSED


def test_a_tunnel_refusal_says_the_sandbox_is_frozen_when_it_is() -> None:
    c = core()
    c.scorer = FakeScorer()  # type: ignore[assignment]
    [reply] = only(c.on_query(query("tunnel.cdn.test", edns=True), "c", False, 0.0), Reply)
    [opt] = [rr for rr in DNSRecord.parse(reply.data).ar if rr.rtype == QTYPE.OPT]
    text = opt.rdata[0].data[2:].decode()
    assert text == (
        "egress: DNS tunnel suspected by policy t (tunnel); the sandbox is frozen for review"
    )
    # A class the policy only blocks says nothing of a freeze.
    [reply] = only(c.on_query(query("denied.test", edns=True), "c", False, 0.0), Reply)
    assert b"frozen" not in reply.data


def test_a_withheld_answer_is_not_asked_upstream_again() -> None:
    c = core()
    [fwd] = c.on_query(query("alias.test"), "c", False, 0.0)
    records = (RR("alias.test", QTYPE.CNAME, rdata=CNAME("denied.test"), ttl=60),)
    acked(c, fwd.token, upstream_answer(fwd, *records), 0.0)
    again = c.on_query(query("alias.test", qid=9), "c", False, 1.0)
    assert not only(again, Forward)
    [reply] = only(again, Reply)
    msg = DNSRecord.parse(reply.data)
    assert msg.header.id == 9 and msg.header.rcode == wire.NXDOMAIN


def test_a_cname_into_no_real_tld_is_a_tunnel() -> None:
    c = core()
    [fwd] = c.on_query(query("a.cdn.test"), "c", False, 0.0)
    records = (RR("a.cdn.test", QTYPE.CNAME, rdata=CNAME("hkzaugs0juqae4aa.dh"), ttl=0),)
    actions = acked(c, fwd.token, upstream_answer(fwd, *records), 0.0)
    [report] = only(actions, Report)
    assert report.violation.cls is ViolationClass.TUNNEL
    [reply] = only(actions, Reply)
    assert DNSRecord.parse(reply.data).rr == []


def test_binary_labels_under_an_allowed_wildcard_are_a_tunnel_and_not_forwarded() -> None:
    c = core()
    q = DNSRecord.question("placeholder.cdn.test", "TXT")
    q.header.id = 5
    raw = bytearray(q.pack())
    raw[13:24] = b"aaaa=h1caa+"  # dns2tcp-style bytes in the first label
    actions = c.on_query(bytes(raw), "c", False, 0.0)
    assert not only(actions, Forward)
    [report] = only(actions, Report)
    assert report.violation.cls is ViolationClass.TUNNEL
    # Outside every rule it stays a denied name.
    q2 = bytearray(DNSRecord.question("placeholder.elsewhere.test").pack())
    q2[13:24] = b"aaaa=h1caa+"
    [report2] = only(c.on_query(bytes(q2), "c", False, 0.0), Report)
    assert report2.violation.cls is ViolationClass.DENIED_NAME


def test_an_answer_is_cached_only_once_the_kernel_has_its_addresses() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60)
    [act] = c.on_upstream_reply(fwd.token, upstream_answer(fwd, rr), 0.0)
    assert isinstance(act, AllowThenReply)
    # The set update failed: the client gets SERVFAIL, and the retry must go upstream
    # again, not come back from the cache.
    [servfail] = c.on_allowed(act.token, 0, 0.5)
    assert isinstance(servfail, Reply) and servfail.data == act.replies[0].fallback
    assert only(c.on_query(query("allowed.test"), "c", False, 1.0), Forward)


def test_address_ttls_never_outlive_the_kernels_timeout() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    records = (
        RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=3000),
        RR("allowed.test", QTYPE.A, rdata=A("203.0.113.11"), ttl=10),
    )
    [act] = c.on_upstream_reply(fwd.token, upstream_answer(fwd, *records), 0.0)
    assert act.update.timeout_s == 10
    assert [r.ttl for r in DNSRecord.parse(act.replies[0][1]).rr] == [10, 10]


def test_the_core_plans_timeouts_so_no_answer_shortens_an_earlier_one() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=300)
    [first] = acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    assert [(a.set_name, a.timeout_s) for a in first.adds] == [("allow4", 300)]
    # 100 s later another name answers the same address with a 5 s TTL: 200 s are left.
    [fwd2] = c.on_query(query("x.cdn.test"), "c", False, 100.0)
    rr2 = RR("x.cdn.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=5)
    [second] = c.on_upstream_reply(fwd2.token, upstream_answer(fwd2, rr2), 100.0)
    assert [(a.timeout_s, a.elements) for a in second.adds] == [(200, second.update.elements4)]
    assert (second.qname, second.qtype, [str(ip) for ip in second.ips]) == (
        "x.cdn.test", 1, ["203.0.113.10"],
    )  # fmt: skip


def test_an_ack_too_late_is_servfail_and_takes_back_only_what_this_answer_added() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=300)
    acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    [fwd2] = c.on_query(query("x.cdn.test"), "c", False, 10.0)
    records = (
        RR("x.cdn.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60),  # allowed already
        RR("x.cdn.test", QTYPE.A, rdata=A("203.0.113.20"), ttl=60),  # new
    )
    [act] = c.on_upstream_reply(fwd2.token, upstream_answer(fwd2, *records), 10.0)
    revoke, servfail = c.on_allowed(act.token, len(act.adds), 10.5, late=True)
    assert isinstance(revoke, Revoke)
    assert revoke.update.elements4 == ("203.0.113.20 . tcp . 80", "203.0.113.20 . tcp . 443")
    assert isinstance(servfail, Reply) and servfail.data == act.replies[0].fallback
    assert c.on_allowed(act.token, len(act.adds), 10.5) == []  # answered once only
    assert only(c.on_query(query("x.cdn.test"), "c", False, 11.0), Forward)  # not cached


def test_a_partial_ack_is_servfail_and_books_only_the_acked_adds() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=300)
    acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    [fwd2] = c.on_query(query("x.cdn.test"), "c", False, 100.0)
    records = (
        RR("x.cdn.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60),  # 200 s left: its own add
        RR("x.cdn.test", QTYPE.A, rdata=A("203.0.113.30"), ttl=60),
    )
    [act] = c.on_upstream_reply(fwd2.token, upstream_answer(fwd2, *records), 100.0)
    assert [a.timeout_s for a in act.adds] == [200, 60]
    [servfail] = c.on_allowed(act.token, 1, 100.0)  # the second add failed
    assert isinstance(servfail, Reply) and servfail.data == act.replies[0].fallback
    assert c.expiry.fresh(("203.0.113.30 . tcp . 443",), 101.0) == ["203.0.113.30 . tcp . 443"]
    assert c.expiry.fresh(("203.0.113.10 . tcp . 443",), 101.0) == []


def test_an_answer_arriving_after_a_swap_that_removed_its_name_is_servfail() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    narrower, _ = parse_policy(POLICY.format(mode="enforce", denied="nxdomain")
                               .replace("      - allowed.test\n", ""), "t.yaml")  # fmt: skip
    c.set_policy(narrower)
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60)
    [act] = c.on_upstream_reply(fwd.token, upstream_answer(fwd, rr), 0.1)
    assert isinstance(act, Reply)
    assert DNSRecord.parse(act.data).header.rcode == wire.SERVFAIL


def test_an_audit_answer_to_a_denied_name_is_not_released_after_a_swap_to_enforce() -> None:
    c = core(mode="audit")
    [_, fwd] = c.on_query(query("denied.test"), "c", False, 0.0)  # reported, forwarded
    assert isinstance(fwd, Forward)
    enforce, _ = parse_policy(POLICY.format(mode="enforce", denied="nxdomain"), "t.yaml")
    c.set_policy(enforce)
    rr = RR("denied.test", QTYPE.A, rdata=A("203.0.113.66"), ttl=60)
    [act] = c.on_upstream_reply(fwd.token, upstream_answer(fwd, rr), 0.1)
    assert isinstance(act, Reply)
    assert DNSRecord.parse(act.data).header.rcode == wire.SERVFAIL
    assert not c.cache._entries  # and nothing cached as if it were allowed


def test_the_expiry_book_keeps_the_monotonic_clock_when_the_wall_clock_steps() -> None:
    mono = [0.0]
    policy, _ = parse_policy(POLICY.format(mode="enforce", denied="nxdomain"), "t.yaml")
    c = ResolverCore(policy, 2, random.Random(7).getrandbits, monotonic=lambda: mono[0])
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=300)
    acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    mono[0] = 100.0  # 100 s pass; the wall clock jumps 1,000 s ahead
    [fwd2] = c.on_query(query("x.cdn.test"), "c", False, 1100.0)
    rr2 = RR("x.cdn.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=5)
    [second] = c.on_upstream_reply(fwd2.token, upstream_answer(fwd2, rr2), 1100.0)
    assert [a.timeout_s for a in second.adds] == [200]  # not shortened to 5 s
