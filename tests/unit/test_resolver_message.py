"""The hand reader and builder of upstream answers, checked against dnslib."""

from __future__ import annotations

import contextlib

import pytest
from dnslib import AAAA, CNAME, MX, NS, QTYPE, RR, SOA, SRV, TXT, A, DNSRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from egress.resolver import message, message_dnslib, wire

LABEL = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_", min_size=1,
                max_size=20)  # fmt: skip
NAME = st.lists(LABEL, min_size=1, max_size=4).map(".".join)


def _record(kind: str, owner: str, target: str, ttl: int, n: int) -> RR:
    rdata = {
        "A": lambda: A(f"203.0.113.{n % 256}"),
        "AAAA": lambda: AAAA(f"2001:db8::{n:x}"),
        "CNAME": lambda: CNAME(target),
        "NS": lambda: NS(target),
        "MX": lambda: MX(target, n % 100),
        "TXT": lambda: TXT(f"text {n}"),
    }[kind]()
    return RR(owner, getattr(QTYPE, kind), rdata=rdata, ttl=ttl)


RECORD = st.builds(
    _record,
    st.sampled_from(["A", "AAAA", "CNAME", "NS", "MX", "TXT"]),
    NAME,
    NAME,
    st.integers(0, 2**31 - 1),
    st.integers(0, 65535),
)


@settings(max_examples=300, deadline=None)
@given(
    qname=NAME,
    answers=st.lists(RECORD, max_size=6),
    auth=st.lists(RECORD, max_size=2),
    soa=st.booleans(),
    rcode=st.sampled_from([0, 2, 3, 5]),
)
def test_the_hand_reader_agrees_with_dnslib(
    qname: str, answers: list[RR], auth: list[RR], soa: bool, rcode: int
) -> None:
    msg = DNSRecord.question(qname, "A").reply()
    msg.header.rcode = rcode
    for rr in answers:
        msg.add_answer(rr)
    for rr in auth:
        msg.add_auth(rr)
    if soa:
        msg.add_auth(RR(qname, QTYPE.SOA, rdata=SOA("ns." + qname, "h." + qname, (1, 2, 3, 4, 5))))
    data = bytes(msg.pack())  # dnslib compresses every name it can
    assert message.parse(data) == message_dnslib.from_dnslib(data)


def test_records_are_lowercased_decompressed_and_rebuilt() -> None:
    msg = DNSRecord.question("Alias.TEST", "A").reply()
    msg.add_answer(RR("Alias.TEST", QTYPE.CNAME, rdata=CNAME("Target.Test"), ttl=60))
    msg.add_answer(RR("Target.Test", QTYPE.A, rdata=A("203.0.113.7"), ttl=30))
    msg.add_auth(RR("test", QTYPE.SOA, rdata=SOA("ns.test", "h.test", (1, 2, 3, 4, 99)), ttl=300))
    r = message.parse(bytes(msg.pack()))
    assert r.questions == [("alias.test", 1, 1)]
    cname, a = r.answers
    assert (cname.name, cname.target, a.name, a.rdata) == (
        "alias.test", "target.test", "target.test", bytes([203, 0, 113, 7]))  # fmt: skip
    [soa] = r.authority
    assert soa.soa_minimum() == 99
    built, offsets = message.build("alias.test", 1, 0, r.answers, r.authority)
    again = DNSRecord.parse(built)
    assert [str(rr.rdata).lower() for rr in again.rr] == ["target.test.", "203.0.113.7"]
    assert [rr.ttl for rr in again.rr + again.auth] == [60, 30, 300]
    assert offsets == wire.ttl_offsets(built)


def test_unknown_types_are_left_to_dnslib() -> None:
    msg = DNSRecord.question("srv.test", "SRV").reply()
    msg.add_answer(RR("srv.test", QTYPE.SRV, rdata=SRV(0, 5, 80, "host.test"), ttl=60))
    data = bytes(msg.pack())
    with pytest.raises(message.Unsupported):
        message.parse(data)
    [rr] = message_dnslib.from_dnslib(data).answers
    assert rr.rtype == QTYPE.SRV and rr.rdata.endswith(b"\x04host\x04test\x00")


@pytest.mark.parametrize(
    "data",
    [
        b"\x00" * 11,
        # a pointer to itself, and one pointing forwards: loops are impossible
        bytes.fromhex("abcd81800001000000000000c00c00010001"),
        bytes.fromhex("abcd81800001000000000000c01000010001"),
        # an A record whose rdata says 5 bytes
        bytes.fromhex("abcd8180000100010000000001610000010001c00c000100010000003c000501020304ff"),
        # rdata running past the end
        bytes.fromhex("abcd8180000100010000000001610000010001c00c000100010000003c0004010203"),
        # an extended label type
        bytes.fromhex("abcd81800001000000000000410000010001"),
    ],
)
def test_malformed_answers_are_rejected(data: bytes) -> None:
    with pytest.raises(wire.WireError):
        message.parse(data)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_the_reader_never_fails_otherwise(data: bytes) -> None:
    with contextlib.suppress(wire.WireError, message.Unsupported):
        message.parse(data)


def test_truncated_answers_stop_at_the_question() -> None:
    data = bytes.fromhex("abcd83800001000500000000016100000100010c")  # TC, 5 records cut off
    r = message.parse(data)
    assert r.truncated and r.answers == [] and r.questions == [("a", 1, 1)]


def test_labels_that_are_not_hostnames_are_escaped() -> None:
    assert wire.name_text([b"Allowed.Test"]) == "allowed\\046test"  # one label, not two
    assert wire.name_text([b"a\x00", b"*", b"x_y"]) == "a\\000.*.x_y"
    assert not wire.is_hostname("allowed\\046test") and not wire.is_hostname("*.a")
    assert wire.is_hostname("_http._tcp.a-b.test")
    for labels in ([b"a.b", b"\xff\\"], [b"plain"]):
        assert wire.encode_name(wire.name_text(labels)) == message.encode_labels(labels)
