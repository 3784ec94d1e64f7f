"""Names bound to the addresses they put in a sandbox's sets, and the verdict on a flow's
first bytes against them (resolver.bindings, resolver.flows; issue 14, item 1)."""

from __future__ import annotations

import ipaddress
import ssl

import pytest
from dnslib import CNAME, QTYPE, RR, A
from test_resolver_core import acked, core, only, query, upstream_answer

from egress.datapath.firstbytes import judge
from egress.model import PortRange, Ports
from egress.policy.matcher import Matcher
from egress.resolver.actions import AllowThenReply, Forward
from egress.resolver.bindings import Bindings
from egress.resolver.flows import judge_flow

IP1 = ipaddress.ip_address("203.0.113.10")
IP2 = ipaddress.ip_address("203.0.113.11")
IP6 = ipaddress.ip_address("2001:db8:80::10")
WEB = Ports(tcp=(PortRange(80, 80), PortRange(443, 443)))


# --- the table -----------------------------------------------------------------------------


def test_a_name_is_bound_to_its_addresses_until_its_timeout() -> None:
    b = Bindings()
    b.learn([IP1, IP6], ["allowed.test"], WEB, 0.0, 60.0)
    assert b.bound(IP1, "allowed.test", 443, 59.9) and b.bound(IP6, "ALLOWED.test.", 443, 0.0)
    assert not b.bound(IP1, "allowed.test", 443, 60.0)
    assert not b.bound(IP2, "allowed.test", 443, 1.0)
    assert not b.bound(IP1, "other.test", 443, 1.0)
    assert b.names(IP1, 1.0) == ("allowed.test",) and b.names(IP1, 61.0) == ()


def test_a_shorter_answer_never_shortens_a_binding() -> None:
    b = Bindings()
    b.learn([IP1], ["a.test"], WEB, 0.0, 300.0)
    b.learn([IP1], ["a.test", "b.test"], WEB, 10.0, 20.0)
    assert b.bound(IP1, "a.test", 443, 200.0) and not b.bound(IP1, "b.test", 443, 21.0)


def test_a_name_is_bound_on_its_rules_ports_only() -> None:
    b = Bindings()
    b.learn([IP1], ["web.test"], Ports(tcp=(PortRange(443, 443),)), 0.0, 60.0)
    b.learn([IP1], ["ssh.test"], Ports(tcp=(PortRange(22, 22),)), 0.0, 60.0)
    assert b.bound(IP1, "web.test", 443, 1.0) and not b.bound(IP1, "web.test", 22, 1.0)
    assert b.bound(IP1, "ssh.test", 22, 1.0) and not b.bound(IP1, "ssh.test", 443, 1.0)
    # the same name through a rule with other ports (a new policy): the new ports count
    b.learn([IP1], ["web.test"], Ports(tcp=(PortRange(8000, 8100),)), 2.0, 30.0)
    assert b.bound(IP1, "web.test", 8080, 3.0) and not b.bound(IP1, "web.test", 443, 3.0)


def test_an_answer_with_no_names_binds_nothing_and_breaks_nothing() -> None:
    b = Bindings(max_addresses=1)
    b.learn([IP1], [], WEB, 0.0, 60.0)
    b.learn([IP1], ["a.test"], WEB, 0.0, 60.0)
    b.learn([IP2], ["b.test"], WEB, 61.0, 120.0)
    assert b.names(IP2, 62.0) == ("b.test",) and len(b) == 1
    with pytest.raises(ValueError):
        Bindings(max_names=0)
    with pytest.raises(ValueError):
        Bindings(max_names=8, max_pairs=7)


def test_a_full_address_replaces_the_name_that_expires_first() -> None:
    b = Bindings(max_names=3)
    for i, until in enumerate((50.0, 10.0, 30.0)):
        b.learn([IP1], [f"n{i}.test"], WEB, 0.0, until)
    b.learn([IP1], ["new.test"], WEB, 0.0, 40.0)
    assert set(b.names(IP1, 0.0)) == {"n0.test", "n2.test", "new.test"}


def test_of_names_that_expire_together_a_full_address_replaces_the_first_learned() -> None:
    b = Bindings(max_names=3)
    for name, until in (("n0.test", 30.0), ("n1.test", 10.0), ("n2.test", 10.0)):
        b.learn([IP1], [name], WEB, 0.0, until)
    b.learn([IP1], ["new.test"], WEB, 0.0, 40.0)
    assert b.names(IP1, 0.0) == ("n0.test", "n2.test", "new.test")
    forever = Bindings(max_names=2)  # e.g. what a handover restores, unbounded
    for name in ("a.test", "b.test", "c.test"):
        forever.learn([IP1], [name], WEB, 0.0, float("inf"))
    assert forever.names(IP1, 0.0) == ("b.test", "c.test")


def test_an_address_keeps_the_many_names_a_cdn_serves_from_it() -> None:
    b = Bindings()
    names = [f"w{i}.cdn.test" for i in range(300)]
    for i, name in enumerate(names):
        b.learn([IP1], [name], WEB, float(i), 1000.0)
    assert all(b.bound(IP1, name, 443, 500.0) for name in names)
    assert b.names(IP1, 500.0) == tuple(names)


def test_bindings_in_all_are_bounded_and_the_oldest_addresses_go_first() -> None:
    b = Bindings(max_addresses=100, max_names=8, max_pairs=16)
    ips = [ipaddress.ip_address(f"198.51.100.{i}") for i in range(6)]
    for i, ip in enumerate(ips[:4]):  # 4 addresses x 4 names: full
        b.learn([ip], [f"n{k}.test" for k in range(4)], WEB, float(i), 100.0)
    b.learn([ips[4]], ["new.test"], WEB, 10.0, 100.0)  # the oldest eighth (1 address) goes
    assert [len(b.names(ip, 10.0)) for ip in ips[:5]] == [0, 4, 4, 4, 1]
    b.learn([ips[1]], ["n0.test"], WEB, 60.0, 200.0)  # learned again: now the newest
    b.learn([ips[4]], [f"more{k}.test" for k in range(4)], WEB, 60.0, 100.0)  # 1 over
    assert [len(b.names(ip, 60.0)) for ip in ips[:5]] == [0, 4, 0, 4, 5]
    b.learn([ips[5]], [f"late{k}.test" for k in range(4)], WEB, 150.0, 300.0)  # 1 over
    # What had ended went (not the oldest live: ips[1] still binds n0 until 200).
    assert [len(b.names(ip, 150.0)) for ip in ips] == [0, 1, 0, 0, 0, 4]
    assert b._pairs == sum(len(bound) for bound in b._table.values()) == 8


def test_an_address_learning_a_name_is_not_what_makes_room_for_it() -> None:
    """Full, with every binding ended: the address given a new name stays, others go."""
    b = Bindings(max_addresses=100, max_names=8, max_pairs=8)
    for ip in (IP1, IP2):
        b.learn([ip], [f"n{k}.test" for k in range(4)], WEB, 0.0, 10.0)
    b.learn([IP1], ["again.test"], WEB, 20.0, 50.0)
    assert b.bound(IP1, "again.test", 443, 20.0) and b.names(IP2, 0.0) == ()
    assert b._pairs == 5


def test_a_full_table_drops_what_expired_then_what_it_learned_longest_ago() -> None:
    b = Bindings(max_addresses=16)
    ips = [ipaddress.ip_address(f"198.51.100.{i}") for i in range(20)]
    for i, ip in enumerate(ips[:16]):
        b.learn([ip], ["x.test"], WEB, float(i), 100.0 if i % 2 else 5.0)  # evens expire at 5
    b.learn([ips[16]], ["x.test"], WEB, 10.0, 100.0)  # full: the 8 expired go
    assert len(b) == 9 and all(b.bound(ip, "x.test", 443, 10.0) for ip in ips[1:17:2])
    for ip in ips[17:]:
        b.learn([ip], ["x.test"], WEB, 11.0, 100.0)
    for ip in (ipaddress.ip_address(f"192.0.2.{i}") for i in range(10)):
        b.learn([ip], ["y.test"], WEB, 12.0, 100.0)
    assert len(b) <= 16
    assert not b.bound(ips[1], "x.test", 443, 12.0)  # the oldest live one made room
    assert b.bound(ipaddress.ip_address("192.0.2.9"), "y.test", 443, 12.0)


# --- the verdict -----------------------------------------------------------------------------


def hello(name: str) -> bytes:
    """A real ClientHello for ``name`` (Python's ssl, no network)."""
    ctx = ssl.create_default_context()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


def matcher() -> Matcher:
    c = core()
    return c.matcher


@pytest.mark.parametrize(
    ("data", "allowed", "reason"),
    [
        (hello("allowed.test"), True, ""),
        (b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n", True, ""),
        (b"GET / HTTP/1.1\r\nHost: alias.test:80\r\n\r\n", False, "not_resolved_here"),
        (hello("denied.test"), False, "name_not_allowed"),
        (b"GET / HTTP/1.1\r\nHost: denied.test\r\n\r\n", False, "name_not_allowed"),
        (b"GET / HTTP/1.1\r\n\r\n", False, "no_host"),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", False, "http2_prior_knowledge"),
        (b"\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00", False, "malformed"),
    ],
)
def test_a_flow_passes_only_for_an_allowed_name_resolved_to_its_address_here(
    data: bytes, allowed: bool, reason: str
) -> None:
    b = Bindings()
    b.learn([IP1], ["allowed.test"], WEB, 0.0, 60.0)
    b.learn([IP2], ["alias.test"], WEB, 0.0, 60.0)  # resolved, but to another address
    v = judge_flow(judge(data), IP1, 443, b, matcher(), 1.0)
    assert (v.allowed, v.reason) == (allowed, reason), v
    if not allowed and v.name:
        assert v.name in v.detail and "203.0.113.10:443" in v.detail


def test_a_binding_past_its_timeout_no_longer_lets_a_flow_through() -> None:
    b = Bindings()
    b.learn([IP1], ["allowed.test"], WEB, 0.0, 60.0)
    v = judge_flow(judge(hello("allowed.test")), IP1, 443, b, matcher(), 61.0)
    assert (v.allowed, v.reason) == (False, "not_resolved_here")
    assert "resolved for no name now" in v.detail


def test_a_mismatch_lists_a_few_of_the_names_its_address_was_resolved_for() -> None:
    b = Bindings()
    b.learn([IP1], [f"w{i}.cdn.test" for i in range(30)], WEB, 0.0, 60.0)
    v = judge_flow(judge(hello("allowed.test")), IP1, 443, b, matcher(), 1.0)
    assert (v.allowed, v.reason) == (False, "not_resolved_here")
    listed = ", ".join(f"w{i}.cdn.test" for i in range(8))
    assert f"resolved for {listed} and 22 more)" in v.detail, v.detail


def test_need_more_is_the_callers_to_wait_on() -> None:
    with pytest.raises(ValueError, match="NEED_MORE"):
        judge_flow(judge(hello("allowed.test")[:20]), IP1, 443, Bindings(), matcher(), 0.0)


# --- the resolver core binds what the kernel allowed ----------------------------------------


def test_the_core_binds_the_question_and_its_cname_chain_once_the_kernel_acks() -> None:
    c = core()
    [fwd] = c.on_query(query("alias.test"), "c", False, 0.0)
    records = (
        RR("alias.test", QTYPE.CNAME, rdata=CNAME("allowed.test"), ttl=60),
        RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60),
    )
    [act] = c.on_upstream_reply(fwd.token, upstream_answer(fwd, *records), 0.0)
    assert isinstance(act, AllowThenReply)
    assert c.bindings.names(IP1, 0.0) == ()  # not before the kernel has the addresses
    c.on_allowed(act.token, len(act.adds), 0.1)
    assert c.bindings.names(IP1, 1.0) == ("alias.test", "allowed.test")
    assert not c.bindings.bound(IP1, "alias.test", 443, 0.0 + act.update.timeout_s)


def test_a_flow_on_a_port_only_another_names_rule_allows_is_a_mismatch() -> None:
    # allowed.test (ports 80, 443) and api.test (443 only) answer with one address: a
    # flow to port 80 asking for api.test passes the kernel (allowed.test's element) but
    # not this check.
    c = core()
    for name in ("allowed.test", "api.test"):
        [fwd] = c.on_query(query(name), "c", False, 0.0)
        rr = RR(name, QTYPE.A, rdata=A("203.0.113.10"), ttl=60)
        acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    request = b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n"
    assert judge_flow(judge(request), IP1, 443, c.bindings, c.matcher, 1.0).allowed
    v = judge_flow(judge(request), IP1, 80, c.bindings, c.matcher, 1.0)
    assert (v.allowed, v.reason) == (False, "not_resolved_here") and "port 80" in v.detail


def test_only_the_question_and_its_cname_chain_are_bound_also_unfiltered() -> None:
    c = core(mode="audit")  # audit: an answer with a finding goes back unfiltered
    [fwd] = only(c.on_query(query("alias.test"), "c", False, 0.0), Forward)
    records = (
        RR("alias.test", QTYPE.CNAME, rdata=CNAME("allowed.test"), ttl=60),
        RR("other.test", QTYPE.CNAME, rdata=CNAME("evil.test"), ttl=60),  # off the chain
        RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60),
        RR("allowed.test", QTYPE.A, rdata=A("10.1.2.3"), ttl=60),  # rebinding: a finding
    )
    acked(c, fwd.token, upstream_answer(fwd, *records), 0.0)
    assert c.bindings.names(IP1, 1.0) == ("alias.test", "allowed.test")


def test_a_failed_or_late_set_update_binds_nothing() -> None:
    for late in (False, True):
        c = core()
        [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
        rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60)
        [act] = c.on_upstream_reply(fwd.token, upstream_answer(fwd, rr), 0.0)
        c.on_allowed(act.token, len(act.adds) if late else 0, 0.5, late=late)
        assert c.bindings.names(IP1, 1.0) == ()


def test_a_cache_hit_that_refreshes_the_sets_refreshes_the_binding() -> None:
    c = core()
    [fwd] = c.on_query(query("allowed.test"), "c", False, 0.0)
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=600)
    acked(c, fwd.token, upstream_answer(fwd, rr), 0.0)
    [entry] = c.cache._entries.values()
    entry.allowed_until = 100.0
    c.bindings = Bindings()  # as if forgotten: only the refresh can bind it again
    [hit] = c.on_query(query("allowed.test"), "c", False, 50.0)
    c.on_allowed(hit.token, len(hit.adds), 50.0)
    assert c.bindings.bound(IP1, "allowed.test", 443, 599.0)


def test_another_sandboxs_answers_bind_nothing_here() -> None:
    mine, theirs = core(), core()
    [fwd] = only(theirs.on_query(query("allowed.test"), "c", False, 0.0), Forward)
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60)
    acked(theirs, fwd.token, upstream_answer(fwd, rr), 0.0)
    v = judge_flow(judge(hello("allowed.test")), IP1, 443, mine.bindings, mine.matcher, 1.0)
    assert (v.allowed, v.reason) == (False, "not_resolved_here")
    v = judge_flow(judge(hello("allowed.test")), IP1, 443, theirs.bindings, theirs.matcher, 1.0)
    assert v.allowed


# --- an adopted sandbox: what a predecessor's answers allowed -------------------------------


def test_an_inherited_address_passes_allowed_names_on_its_ports_until_it_expires() -> None:
    # egressd adopted the sandbox after a crash: the kernel holds 203.0.113.10 on 443,
    # which a client may still have cached, for a name nobody here saw answered.
    c = core()
    elements = [("203.0.113.10 . tcp . 443", 30), ("203.0.113.11 . udp . 443", 30),
                ("bad . tcp . 443", 30), ("203.0.113.11 . tcp . x", 30)]  # fmt: skip
    c.seed_expiry(elements, 100.0)
    ok = judge_flow(judge(hello("alias.test")), IP1, 443, c.bindings, c.matcher, 129.0)
    assert ok.allowed, ok
    for data, port, now, reason in (
        (hello("denied.test"), 443, 129.0, "name_not_allowed"),  # still only allowed names
        (hello("alias.test"), 80, 129.0, "not_resolved_here"),  # not on another port
        (hello("alias.test"), 443, 130.0, "not_resolved_here"),  # not after it expires
    ):
        v = judge_flow(judge(data), IP1, port, c.bindings, c.matcher, now)
        assert (v.allowed, v.reason) == (False, reason), v
    v = judge_flow(judge(hello("alias.test")), IP2, 443, c.bindings, c.matcher, 101.0)
    assert (v.allowed, v.reason) == (False, "not_resolved_here")  # never in the sets


def test_a_handover_names_the_questions_so_nothing_is_inherited() -> None:
    c = core()
    c.seed_expiry([("203.0.113.10 . tcp . 443", 30)], 100.0, inherit=False)
    v = judge_flow(judge(hello("alias.test")), IP1, 443, c.bindings, c.matcher, 101.0)
    assert (v.allowed, v.reason) == (False, "not_resolved_here")


def test_an_inherited_address_passes_a_name_only_on_its_rules_ports() -> None:
    # api.test's rule allows port 443 only: an inherited element on port 80 (put there
    # for another name) does not let a flow asking for api.test through on 80.
    c = core()
    c.seed_expiry([("203.0.113.10 . tcp . 80", 30), ("203.0.113.10 . tcp . 443", 30)], 100.0)
    ok = judge_flow(judge(hello("api.test")), IP1, 443, c.bindings, c.matcher, 101.0)
    assert ok.allowed, ok
    v = judge_flow(judge(hello("api.test")), IP1, 80, c.bindings, c.matcher, 101.0)
    assert (v.allowed, v.reason) == (False, "not_resolved_here")
    c.bindings.forget_inherited()  # a policy swap
    v = judge_flow(judge(hello("api.test")), IP1, 443, c.bindings, c.matcher, 101.0)
    assert (v.allowed, v.reason) == (False, "not_resolved_here")
