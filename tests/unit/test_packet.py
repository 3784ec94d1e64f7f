"""egress.datapath.packet: hand-built IPv4/IPv6 packets in, flows out; garbage never raises."""

from __future__ import annotations

import ipaddress
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egress.datapath.nflog_wire import udp4_payload
from egress.datapath.packet import Packet, parse_ip_packet
from egress.model import Flow

SRC4, DST4 = "10.1.2.3", "192.0.2.10"
SRC6, DST6 = "fd00::2", "2001:db8::53"


# ---- builders ---------------------------------------------------------------------


def ipv4(
    proto: int, l4: bytes, options: bytes = b"", frag: int = 0, total: int | None = None
) -> bytes:
    ihl = 5 + len(options) // 4
    length = total if total is not None else ihl * 4 + len(l4)
    header = struct.pack(
        "!BBHHHBBH4s4s",
        0x40 | ihl,
        0,
        length,
        0x1234,
        frag,
        64,
        proto,
        0,
        ipaddress.IPv4Address(SRC4).packed,
        ipaddress.IPv4Address(DST4).packed,
    )
    return header + options + l4


def ipv6(next_header: int, payload: bytes, plen: int | None = None) -> bytes:
    length = len(payload) if plen is None else plen
    header = struct.pack("!IHBB", 0x60000000, length, next_header, 64)
    return (
        header + ipaddress.IPv6Address(SRC6).packed + ipaddress.IPv6Address(DST6).packed + payload
    )


def tcp(sport: int, dport: int, flags: int = 0x02, data: bytes = b"", doff: int = 5) -> bytes:
    head = struct.pack("!HHIIBBHHH", sport, dport, 1, 0, doff << 4, flags, 65535, 0, 0)
    return head + b"\x01" * (doff * 4 - 20) + data  # NOP options


def udp(sport: int, dport: int, payload: bytes, length: int | None = None) -> bytes:
    size = 8 + len(payload) if length is None else length
    return struct.pack("!HHHH", sport, dport, size, 0) + payload


def icmp(kind: int, code: int) -> bytes:
    return struct.pack("!BBHI", kind, code, 0, 0)


def ext(next_header: int, body_len_units: int = 0) -> bytes:
    """A generic IPv6 extension header (hop-by-hop, routing, dest-opts): 8*(n+1) bytes."""
    return bytes([next_header, body_len_units]) + b"\0" * (6 + 8 * body_len_units)


def frag6(next_header: int, offset: int, more: bool) -> bytes:
    return struct.pack("!BBHI", next_header, 0, (offset << 3) | int(more), 0xABCD)


# ---- IPv4 -------------------------------------------------------------------------


def test_ipv4_tcp_syn() -> None:
    p = parse_ip_packet(ipv4(6, tcp(40000, 443)))
    assert p == Packet(4, "tcp", SRC4, DST4, sport=40000, dport=443, tcp_flags=0x02, seq=1)
    assert p.flow() == Flow("tcp", SRC4, DST4, 40000, 443)
    assert p.proto_number == 6


def test_ipv4_with_options_skips_them() -> None:
    options = bytes([0x94, 0x04, 0, 0]) + b"\x01\x01\x01\x00"  # router alert, NOPs, EOL
    p = parse_ip_packet(ipv4(17, udp(5353, 53, b"q"), options=options))
    assert p is not None
    assert (p.sport, p.dport, p.payload) == (5353, 53, b"q")


def test_ipv4_udp_payload_is_the_dns_query() -> None:
    query = b"\x12\x34\x01\x00\x00\x01" + b"\0" * 6 + b"\x07example\x03com\x00\x00\x01\x00\x01"
    p = parse_ip_packet(ipv4(17, udp(33333, 53, query)))
    assert p is not None
    assert p.proto == "udp"
    assert p.payload == query
    assert not p.truncated


def test_ipv4_ignores_ethernet_padding_after_total_length() -> None:
    p = parse_ip_packet(ipv4(17, udp(1, 2, b"ab")) + b"\0" * 10)
    assert p is not None
    assert p.payload == b"ab"


def test_ipv4_icmp_type_and_code() -> None:
    p = parse_ip_packet(ipv4(1, icmp(8, 0)))
    assert p is not None
    assert (p.proto, p.icmp_type, p.icmp_code, p.sport) == ("icmp", 8, 0, None)
    assert p.flow() == Flow("icmp", SRC4, DST4, 8, 0)


def test_ipv4_other_protocol_is_a_number() -> None:
    p = parse_ip_packet(ipv4(47, b"\0" * 8))  # GRE
    assert p is not None
    assert (p.proto, p.sport, p.dport) == (47, None, None)
    assert p.flow() == Flow("47", SRC4, DST4)


def test_ipv4_first_fragment_has_ports_later_ones_do_not() -> None:
    first = parse_ip_packet(ipv4(17, udp(1000, 53, b"x" * 8), frag=0x2000))  # MF, offset 0
    assert first is not None
    assert (first.fragment, first.dport) == (True, 53)
    later = parse_ip_packet(ipv4(17, b"x" * 16, frag=185))  # offset 185*8, no L4 header
    assert later is not None
    assert (later.fragment, later.proto, later.sport, later.dport) == (True, "udp", None, None)


def test_ipv4_capture_cut_short_is_marked_truncated() -> None:
    full = ipv4(17, udp(1000, 53, b"y" * 200))
    p = parse_ip_packet(full[:100])
    assert p is not None
    assert p.truncated
    assert p.payload == b"y" * (100 - 28)


# ---- IPv6 -------------------------------------------------------------------------


def test_ipv6_tcp() -> None:
    p = parse_ip_packet(ipv6(6, tcp(50000, 8443, flags=0x12)))
    assert p == Packet(6, "tcp", SRC6, DST6, sport=50000, dport=8443, tcp_flags=0x12, seq=1)


def test_tcp_payload_starts_after_the_options() -> None:
    p = parse_ip_packet(ipv4(6, tcp(40000, 443, 0x18, b"\x16\x03\x01", doff=8)))
    assert p is not None and (p.seq, p.payload) == (1, b"\x16\x03\x01")
    bogus = parse_ip_packet(ipv4(6, tcp(40000, 443, 0x18, b"data", doff=2)))
    assert bogus is not None and bogus.payload == b""


def test_ipv6_addresses_are_compressed_text() -> None:
    p = parse_ip_packet(ipv6(17, udp(1, 2, b"")))
    assert p is not None
    assert (p.src, p.dst) == ("fd00::2", "2001:db8::53")


def test_ipv6_walks_hop_by_hop_routing_and_destination_options() -> None:
    # hop-by-hop -> routing -> destination options (16 bytes) -> UDP
    p = parse_ip_packet(ipv6(0, ext(43) + ext(60, 1) + ext(17) + udp(4444, 53, b"dns")))
    assert p is not None
    assert (p.proto, p.sport, p.dport, p.payload) == ("udp", 4444, 53, b"dns")


def test_ipv6_authentication_header_is_skipped() -> None:
    ah = bytes([6, 4]) + b"\0" * 22  # payload len 4 -> (4 + 2) * 4 = 24 bytes
    p = parse_ip_packet(ipv6(51, ah + tcp(1, 22)))
    assert p is not None
    assert (p.proto, p.dport) == ("tcp", 22)


def test_ipv6_fragments() -> None:
    first = parse_ip_packet(ipv6(44, frag6(17, 0, True) + udp(7, 53, b"a" * 8)))
    assert first is not None
    assert (first.fragment, first.sport, first.dport) == (True, 7, 53)
    later = parse_ip_packet(ipv6(44, frag6(17, 100, False) + b"z" * 16))
    assert later is not None
    assert (later.fragment, later.proto, later.dport) == (True, "udp", None)


def test_icmpv6() -> None:
    p = parse_ip_packet(ipv6(58, icmp(128, 0)))
    assert p is not None
    assert (p.proto, p.icmp_type, p.icmp_code) == ("icmpv6", 128, 0)
    assert p.flow() == Flow("icmpv6", SRC6, DST6, 128, 0)


def test_ipv6_esp_and_no_next_header_end_the_walk() -> None:
    esp = parse_ip_packet(ipv6(50, b"\0" * 16))
    assert esp is not None
    assert (esp.proto, esp.sport) == (50, None)
    none = parse_ip_packet(ipv6(59, b""))
    assert none is not None
    assert none.proto == 59


def test_ipv6_capture_cut_short_is_marked_truncated() -> None:
    full = ipv6(17, udp(1, 53, b"q" * 300))
    p = parse_ip_packet(full[:128])
    assert p is not None
    assert p.truncated
    assert p.payload == b"q" * (128 - 48)


# ---- malformed input --------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x45",
        b"\x45" + b"\0" * 18,  # 19 bytes
        b"\x55" + b"\0" * 40,  # version 5
        b"\x00" + b"\0" * 40,  # version 0
        ipv4(6, tcp(1, 2))[:1].replace(b"\x45", b"\x44") + ipv4(6, tcp(1, 2))[1:],  # IHL 4
        ipv4(6, tcp(1, 2), total=10),  # total length shorter than the header
        ipv4(6, tcp(1, 2))[:30],  # TCP header cut
        ipv4(17, udp(1, 2, b"")[:6]),  # UDP header cut
        ipv4(17, udp(1, 2, b"abc", length=4)),  # UDP length below its own header
        ipv4(1, b"\x08\x00"),  # ICMP header cut
        b"\x60" + b"\0" * 30,  # IPv6 header cut
        ipv6(0, b"\x11\x00\x00"),  # extension header cut
        ipv6(0, ext(0) * 12),  # endless hop-by-hop chain
    ],
)
def test_malformed_input_gives_none(data: bytes) -> None:
    assert parse_ip_packet(data) is None


def test_every_prefix_of_valid_packets_parses_or_is_none() -> None:
    samples = [
        ipv4(6, tcp(1, 2), options=b"\x01" * 8),
        ipv4(17, udp(3, 53, b"payload")),
        ipv6(0, ext(60) + frag6(6, 0, True) + tcp(5, 6)),
        ipv6(58, icmp(1, 4)),
    ]
    for sample in samples:
        for cut in range(len(sample) + 1):
            result = parse_ip_packet(sample[:cut])
            assert result is None or isinstance(result, Packet)


@given(st.binary(max_size=600))
def test_random_bytes_never_raise(data: bytes) -> None:
    result = parse_ip_packet(data)
    assert result is None or result.family in (4, 6)


@given(st.binary(min_size=1, max_size=200), st.sampled_from([0, 6, 17, 43, 44, 51, 58, 60]))
def test_random_ipv6_payloads_never_raise(payload: bytes, next_header: int) -> None:
    result = parse_ip_packet(ipv6(next_header, payload))
    assert result is None or result.family == 6


@given(st.binary(max_size=200), st.integers(0, 255), st.integers(0, 0xFFFF))
def test_random_ipv4_bodies_never_raise(body: bytes, proto: int, frag: int) -> None:
    result = parse_ip_packet(ipv4(proto, body, frag=frag))
    assert result is None or result.family == 4


# ---- udp4_payload: the observer's cheap look ------------------------------------------


def test_udp4_payload_is_the_udp_payload_of_a_whole_ipv4_datagram_only() -> None:
    query = b"\x12\x34" + b"q" * 30
    assert udp4_payload(ipv4(17, udp(33333, 53, query))) == query
    assert udp4_payload(ipv4(17, udp(1, 2, b"ab")) + b"\0" * 10) == b"ab"  # padding
    assert udp4_payload(ipv4(6, tcp(1, 53, data=b"\0\x20" + query))) is None
    assert udp4_payload(ipv4(17, udp(1, 53, query), frag=0x2000)) is None  # first fragment
    assert udp4_payload(ipv4(17, udp(1, 53, query), frag=3)) is None
    assert udp4_payload(ipv6(17, udp(1, 53, query))) is None
    assert udp4_payload(ipv4(17, udp(1, 53, query, length=7))) is None
    assert udp4_payload(b"\x45" + b"\0" * 10) is None


@given(
    st.binary(max_size=120),
    st.sampled_from([1, 6, 17, 47]),
    st.sampled_from([0, 0x2000, 0x4000, 1, 185]),
    st.one_of(st.none(), st.integers(0, 200)),
    st.binary(max_size=8).filter(lambda o: len(o) % 4 == 0),
)
def test_udp4_payload_is_never_other_than_what_parse_ip_packet_reads(
    body: bytes, proto: int, frag: int, udp_len: int | None, options: bytes
) -> None:
    """The observer keeps a query judged from ``parse_ip_packet``'s payload under the key
    ``udp4_payload`` gives: whenever the latter has one, it is that same payload."""
    l4 = udp(1000, 53, body, length=udp_len) if proto == 17 else body
    raw = ipv4(proto, l4, options=options, frag=frag)
    cheap = udp4_payload(raw)
    if cheap is None:
        return
    p = parse_ip_packet(raw)
    assert p is not None and p.proto == "udp" and not p.fragment
    assert cheap == p.payload
