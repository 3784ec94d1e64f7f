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
    edns=st.one_of(st.none(), st.integers(0, 0xFFFF)),
    options=st.lists(st.binary(max_size=12), max_size=3),
)  # fmt: skip
def test_a_synthesized_name_is_answered_as_dnslib_answers_it(
    a: int, b: int, case: int, ident: int, rd: bool, cd: bool, edns: int | None,
    options: list[bytes],
) -> None:  # fmt: skip
    name = recase(f"ip-198-19-{a}-{b}.any.lab.test", case)
    flags = (0x0100 if rd else 0) | (0x0010 if cd else 0)
    packed = b"".join(struct.pack("!HH", 10 + i, len(o)) + o for i, o in enumerate(options))
    opt = None if edns is None else opt_record(edns, packed, flags=0x8000)  # DO set
    packet = query(name, ident=ident, flags=flags, opt=opt)
    got = quick(packet)
    assert got is not None  # the path bench_egressd's misses take
    assert got == slow(packet)


@settings(max_examples=300, deadline=None)
@given(
    label=st.sampled_from(["ip-198-19-1-2", "ip-198-20-1-2", "ip-198-19-01-2", "ip-1-2",
                           "host-198-19-1-2", "ip-198-19-1-256", "www", "ip-198-19-3-4.x"]),
    zone=st.sampled_from(["any.lab.test", "lab.test", "any.lab.test.extra", "nowhere"]),
    qtype=st.sampled_from([1, 28, 16, 255, 5]),
    qclass=st.sampled_from([1, 3, 255]),
    flags=st.sampled_from([0x0000, 0x0100, 0x8100, 0x0900, 0x2100, 0x0300, 0x0120, 0x0105]),
    tail=st.sampled_from([b"", b"x", opt_record(1232), opt_record(512, b"\0\x0a\0\x08"),
                          opt_record(512, b"\0\x0a\0\x09abcd"), b"\0\0\x29"]),
)  # fmt: skip
def test_whatever_it_answers_is_what_dnslib_sends(
    label: str, zone: str, qtype: int, qclass: int, flags: int, tail: bytes
) -> None:
    """Other names, types, classes, opcodes, flags and trailing bytes: the quick path
    answers only where its bytes are dnslib's, and leaves the rest to it."""
    head = struct.pack("!6H", 99, flags, 1, 0, 0, 1 if tail[:3] == b"\0\0\x29" else 0)
    packet = head + wire_name(f"{label}.{zone}") + struct.pack("!HH", qtype, qclass) + tail
    got = quick(packet)
    if got is not None:
        assert got == slow(packet)
        assert (label, zone, qtype, qclass) == ("ip-198-19-1-2", "any.lab.test", 1, 1)


def test_a_pointer_in_the_question_or_another_record_is_left_to_dnslib() -> None:
    name = wire_name("ip-198-19-1-2.any.lab.test")
    # "ip-198-19-1-2" then a pointer to "any.lab.test", which follows the question
    pointer = struct.pack("!6H", 1, 0, 1, 0, 0, 0) + b"\x0dip-198-19-1-2\xc0\x20"
    pointer += b"\0\1\0\1" + wire_name("any.lab.test")
    question = dnsmsg.parse_question(pointer)
    assert question is not None and question.key == "ip-198-19-1-2.any.lab.test."
    assert quick(pointer) is None
    two = struct.pack("!6H", 1, 0, 1, 0, 0, 1) + name + b"\0\1\0\1" + wire_name("x") + b"\0\1\0\1"
    two += b"\0\0\0\0\0\0"
    assert quick(two) is None
    assert quick(query("ip-198-19-1-2.any.lab.test", opt=opt_record(512) + b"z")) is None


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
