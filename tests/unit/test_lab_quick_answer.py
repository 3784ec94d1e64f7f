"""The lab DNS's answer built from bytes for synthesized names (authority.quick_answer):
byte for byte what dnslib's path (``encode(answer(...))``) sends, and taken only where
it is sure of that."""

from __future__ import annotations

import struct

import pytest
from dnslib import DNSRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from egress.lab import DEFAULT_ZONES_FILE, dnsmsg, load_zones
from egress.lab.authority import answer, encode, quick_answer
from egress.lab.zones import Relay, ZoneSet

ZONES = load_zones(DEFAULT_ZONES_FILE)


def slow(packet: bytes) -> bytes:
    request = DNSRecord.parse(packet)
    return encode(answer(ZONES, request), request, udp=True)


def quick(packet: bytes) -> bytes | None:
    question = dnsmsg.parse_question(packet)
    assert question is not None
    return quick_answer(ZONES, packet, question)


def wire_name(name: str) -> bytes:
    return b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"


def query(
    name: str, *, ident: int = 7, flags: int = 0x0100, qtype: int = 1, qclass: int = 1,
    opt: bytes | None = None,
) -> bytes:  # fmt: skip
    head = struct.pack("!6H", ident, flags, 1, 0, 0, 1 if opt is not None else 0)
    return head + wire_name(name) + struct.pack("!HH", qtype, qclass) + (opt or b"")


def opt_record(size: int, options: bytes = b"", flags: int = 0) -> bytes:
    return b"\0" + struct.pack("!HHIH", 41, size, flags, len(options)) + options


def recase(name: str, mask: int) -> str:
    return "".join(c.upper() if mask >> (i % 60) & 1 else c for i, c in enumerate(name))


@settings(max_examples=400, deadline=None)
@given(
    a=st.integers(0, 255), b=st.integers(0, 255), case=st.integers(0, (1 << 60) - 1),
    ident=st.integers(0, 0xFFFF), rd=st.booleans(), cd=st.booleans(),
    cleared=st.integers(0, 0x02FF),  # TC, RA, Z, AD and an rcode in the query: not kept
    edns=st.one_of(st.none(), st.integers(0, 0xFFFF)),
    options=st.lists(st.binary(max_size=12), max_size=3),
)  # fmt: skip
def test_a_synthesized_name_is_answered_as_dnslib_answers_it(
    a: int, b: int, case: int, ident: int, rd: bool, cd: bool, cleared: int,
    edns: int | None, options: list[bytes],
) -> None:  # fmt: skip
    name = recase(f"ip-198-19-{a}-{b}.any.lab.test", case)
    flags = (0x0100 if rd else 0) | (0x0010 if cd else 0) | (cleared & 0x02EF)
    packed = b"".join(struct.pack("!HH", 10 + i, len(o)) + o for i, o in enumerate(options))
    opt = None if edns is None else opt_record(edns, packed, flags=0x8000)  # DO set
    packet = query(name, ident=ident, flags=flags, opt=opt)
    got = quick(packet)
    assert got is not None  # the path bench_egressd's misses take
    assert got == slow(packet)


NAME = wire_name("ip-198-19-1-2.any.lab.test")
A_IN = struct.pack("!HH", 1, 1)
RR = b"\0\1\0\1\0\0\0\1\0\4\1\2\3\4"  # an A record's type, class, TTL and data


def packet_of(qd: int = 1, an: int = 0, ns: int = 0, ar: int = 0, body: bytes = b"") -> bytes:
    return struct.pack("!6H", 7, 0x0100, qd, an, ns, ar) + body


# "ip-198-19-1-2", then a pointer to "any.lab.test" inside the OPT record's one option
POINTER = packet_of(
    ar=1,
    body=b"\x0dip-198-19-1-2\xc0\x2f" + A_IN
    + opt_record(512, b"\0\x0a\0\x0e" + wire_name("any.lab.test")),
)  # fmt: skip


@pytest.mark.parametrize(
    ("why", "packet"),
    [
        ("class ANY", packet_of(body=NAME + struct.pack("!HH", 1, 255))),
        ("class CH", packet_of(body=NAME + struct.pack("!HH", 1, 3))),
        ("type AAAA", packet_of(body=NAME + struct.pack("!HH", 28, 1))),
        ("type TXT", packet_of(body=NAME + struct.pack("!HH", 16, 1))),
        ("type ANY", packet_of(body=NAME + struct.pack("!HH", 255, 1))),
        ("two questions", packet_of(qd=2, body=NAME + A_IN + NAME + A_IN)),
        # Counts the packet does not hold (dnslib: FORMERR), or an owner that is no root
        ("two questions counted, one sent", packet_of(qd=2, body=NAME + A_IN)),
        ("an answer counted, none sent", packet_of(an=1, body=NAME + A_IN)),
        ("an authority counted, none sent", packet_of(ns=1, body=NAME + A_IN)),
        ("two additionals counted, one sent", packet_of(ar=2, body=NAME + A_IN + opt_record(512))),
        # A one-byte label where the OPT's root belongs: "\0\x29" still follows it
        ("an owner that is no root",
         packet_of(ar=1, body=NAME + A_IN + b"\1" + opt_record(512)[1:])),
        ("an answer", packet_of(an=1, body=NAME + A_IN + b"\xc0\x0c" + RR)),
        ("an authority", packet_of(ns=1, body=NAME + A_IN + b"\xc0\x0c" + RR)),
        ("OPT and another", packet_of(ar=2, body=NAME + A_IN + opt_record(512) + opt_record(512))),
        ("an OPT not at the root", packet_of(ar=1, body=NAME + A_IN + b"\x01a" + opt_record(512))),
        ("an A record, no OPT", packet_of(ar=1, body=NAME + A_IN + b"\0" + RR)),
        ("an option past the OPT's end",
         packet_of(ar=1, body=NAME + A_IN + opt_record(512)[:-2] + b"\0\6\0\x0a\0\4\1\2")),
        ("a byte after the OPT", packet_of(ar=1, body=NAME + A_IN + opt_record(512) + b"z")),
        ("a byte after the question", packet_of(body=NAME + A_IN + b"z")),
        ("outside 198.19/16", packet_of(body=wire_name("ip-198-20-1-2.any.lab.test") + A_IN)),
        ("a leading zero", packet_of(body=wire_name("ip-198-19-01-2.any.lab.test") + A_IN)),
        ("two octets", packet_of(body=wire_name("ip-1-2.any.lab.test") + A_IN)),
        ("another prefix", packet_of(body=wire_name("host-198-19-1-2.any.lab.test") + A_IN)),
        ("a name of the zone's", packet_of(body=wire_name("www.any.lab.test") + A_IN)),
        ("another zone", packet_of(body=wire_name("ip-198-19-1-2.lab.test") + A_IN)),
        ("a dot inside a label", packet_of(body=b"\x11ip-198-19-1-2.any\x03lab\x04test\0" + A_IN)),
        ("a pointer in the name", POINTER),
    ],
)  # fmt: skip
def test_what_dnslib_must_read_is_left_to_it(why: str, packet: bytes) -> None:
    question = dnsmsg.parse_question(packet)
    assert question is not None, why
    assert quick_answer(ZONES, packet, question) is None, why


def test_the_pointer_case_reads_as_the_name_it_looks_like() -> None:
    """So the pointer check alone refuses it (dnslib, which takes only pointers back,
    answers FORMERR)."""
    question = dnsmsg.parse_question(POINTER)
    assert question is not None and question.key == "ip-198-19-1-2.any.lab.test."
    assert len(POINTER) == 12 + 16 + 4 + 11 + 4 + 14  # nothing after the OPT record


@pytest.mark.parametrize(
    ("why", "flags"), [("a response", 0x8100), ("opcode 1 (dnslib: NOTIMP)", 0x0900),
                       ("opcode 2", 0x1100), ("opcode 5 (UPDATE)", 0x2900)],
)  # fmt: skip
def test_no_quick_answer_to_a_response_or_another_opcode(why: str, flags: int) -> None:
    assert quick(query("ip-198-19-1-2.any.lab.test", flags=flags)) is None, why


def test_a_synthesized_name_under_a_relay_is_relayed_not_answered() -> None:
    relayed = ZoneSet(ZONES.zones, (Relay("any.lab.test.", "127.0.0.1", 5353),))
    packet = query("ip-198-19-1-2.any.lab.test")
    question = dnsmsg.parse_question(packet)
    assert question is not None
    assert quick_answer(ZONES, packet, question) is not None
    assert quick_answer(relayed, packet, question) is None
