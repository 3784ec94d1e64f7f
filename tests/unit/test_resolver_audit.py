"""mode: audit's record (resolver.audit.AuditLog, fed by the core): what `egressctl learn`
reads. Each test drives the core as the shell would and reads what it recorded."""

from __future__ import annotations

import ipaddress

from dnslib import CNAME, QTYPE, RR, A

from egress.resolver.actions import Forward
from egress.resolver.audit import AuditLog
from egress.resolver.core import ResolverCore
from tests.unit.test_resolver_core import acked, core, only, query, upstream_answer


def names(
    c: ResolverCore,
) -> dict[tuple[str, int], tuple[str, int, tuple[str, ...], tuple[str, ...]]]:
    return {
        (r.name, r.qtype): (r.verdict, r.count, r.risks, r.chain) for r in c.audit_log.take().names
    }


def ask(c: ResolverCore, name: str, *records: RR, qtype: str = "A", now: float = 0.0) -> None:
    actions = c.on_query(query(name, qtype), "client", False, now)
    fwds = only(actions, Forward)
    if fwds:
        acked(c, fwds[0].token, upstream_answer(fwds[0], *records), now)


def test_audit_records_every_question_with_the_verdict_enforce_would_give() -> None:
    c = core("audit")
    ask(c, "allowed.test", RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60))
    ask(c, "denied.test", RR("denied.test", QTYPE.A, rdata=A("203.0.113.12"), ttl=60))
    ask(c, "allowed.test", qtype="TXT")
    assert names(c) == {
        ("allowed.test", 1): ("allowed", 1, (), ()),
        ("denied.test", 1): ("denied_name", 1, (), ()),
        ("allowed.test", 16): ("denied_type", 1, (), ()),
    }


def test_enforce_mode_records_nothing() -> None:
    c = core("enforce")
    ask(c, "allowed.test", RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60))
    assert c.audit_log.take().is_empty()


def test_cache_hits_and_byte_identical_repeats_are_counted() -> None:
    """Audit mode keeps repeats off the replay path, which would skip the count."""
    c = core("audit")
    rr = RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60)
    ask(c, "allowed.test", rr)
    for now in (1.0, 1.1, 1.2):
        data = bytes(query("allowed.test"))
        assert c.replay(data, now) is None
        c.on_query(data, "client", False, now)
    [row] = c.audit_log.take().names
    assert (row.count, row.first, row.last) == (4, 0.0, 1.2)


def test_cname_chain_and_rebinding_are_recorded_for_a_name_under_no_rule() -> None:
    c = core("audit")
    ask(c, "www.denied.test",
        RR("www.denied.test", QTYPE.CNAME, rdata=CNAME("edge.denied.test"), ttl=60),
        RR("edge.denied.test", QTYPE.A, rdata=A("10.1.2.3"), ttl=60))  # fmt: skip
    assert names(c)[("www.denied.test", 1)] == (
        "denied_name",
        1,
        ("rebinding",),
        ("edge.denied.test",),
    )


def test_connect_verdict_follows_the_names_whose_answers_gave_the_address() -> None:
    c = core("audit")
    ask(c, "allowed.test", RR("allowed.test", QTYPE.A, rdata=A("203.0.113.10"), ttl=60))
    ask(c, "denied.test", RR("denied.test", QTYPE.A, rdata=A("203.0.113.12"), ttl=60))
    ip = ipaddress.ip_address
    c.audit_connect(ip("203.0.113.10"), "tcp", 443, False, False, 1.0)
    c.audit_connect(ip("203.0.113.12"), "tcp", 443, False, False, 1.0)  # audit let it in
    c.audit_connect(ip("192.0.2.7"), "tcp", 8443, True, False, 1.0)  # connect.allow
    c.audit_connect(ip("192.0.2.8"), "udp", 9, False, True, 1.0)  # the kernel's drop
    got = {(r.address, r.port): (r.verdict, r.names) for r in c.audit_log.take().connects}
    assert got == {
        ("203.0.113.10", 443): ("allowed", ("allowed.test",)),
        ("203.0.113.12", 443): ("blocked_connect", ("denied.test",)),
        ("192.0.2.7", 8443): ("allowed", ()),
        ("192.0.2.8", 9): ("blocked_connect", ()),
    }


def test_the_log_is_bounded_and_counts_what_it_left_out() -> None:
    log = AuditLog(cap=2)
    for i in range(5):
        log.name(f"n{i}.test", 1, "allowed", float(i))
    log.name("n0.test", 1, "allowed", 9.0)  # a known key still counts
    batch = log.take()
    assert [(r.name, r.count, r.last) for r in batch.names] == [
        ("n0.test", 2, 9.0),
        ("n1.test", 1, 1.0),
    ]
    assert batch.over_cap_names == 3
    assert log.take().is_empty()  # deltas reset; entries kept for deduplication
    log.name("n1.test", 1, "allowed", 10.0)
    [row] = log.take().names
    assert (row.count, row.first, row.last) == (1, 1.0, 10.0)


def test_the_name_a_flow_asked_for_is_kept_even_before_its_first_packet_is_logged() -> None:
    log = AuditLog()
    log.asked("192.0.2.1", "tcp", 443, "a.test", 4.0)  # the first bytes, before the SYN's log
    [row] = log.take().connects  # a close now must not lose it
    assert (row.first, row.count, row.asked) == (4.0, 0, ("a.test",))
    log.connect("192.0.2.1", "tcp", 443, "allowed", ("a.test", "b.test"), 5.0)
    log.asked("192.0.2.1", "tcp", 443, "a.test", 5.0)
    [row] = log.take().connects
    assert (row.first, row.count, row.names, row.asked) == (
        4.0,
        1,
        ("a.test", "b.test"),
        ("a.test",),
    )


def test_a_blocked_flow_makes_its_destination_blocked_for_good() -> None:
    log = AuditLog()
    log.connect("192.0.2.1", "tcp", 80, "blocked_connect", (), 1.0)
    log.connect("192.0.2.1", "tcp", 80, "allowed", ("x.test",), 2.0)
    [row] = log.take().connects
    assert (row.verdict, row.count, row.names) == ("blocked_connect", 2, ("x.test",))
