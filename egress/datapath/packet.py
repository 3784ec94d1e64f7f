"""Parse the IP packets the kernel copies to us (NFLOG) into a flow description.

Pure: bytes in, a frozen ``Packet`` (or None) out; ``Packet.flow()`` gives the
``egress.model.Flow`` that violations carry. The kernel hands the observer raw IPv4
or IPv6 packets, possibly cut short at the NFLOG copy range; the observer needs the
5-tuple to report a blocked connect and the UDP payload to inspect DNS queries itself.
The input comes from a sandbox an attacker controls, so malformed, truncated or hostile
bytes must yield None, never an exception.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass, replace

from egress.model import Flow

PROTO_NAMES = {1: "icmp", 6: "tcp", 17: "udp", 58: "icmpv6"}
PROTO_NUMBERS = {name: number for number, name in PROTO_NAMES.items()}
# IPv6 extension headers we walk past to find the transport header. ESP (50) hides
# what follows; No Next Header (59) ends the chain.
_V6_EXT_GENERIC = frozenset({0, 43, 60})  # hop-by-hop, routing, destination options
_V6_FRAGMENT = 44
_V6_AH = 51
_MAX_EXT_HEADERS = 10


@dataclass(frozen=True)
class Packet:
    """One packet's addressing. Ports and ICMP fields are None where the packet has
    none (other protocols, or a non-first fragment, which carries no L4 header)."""

    family: int  # 4 or 6
    proto: str | int  # 'tcp' | 'udp' | 'icmp' | 'icmpv6', else the protocol number
    src: str  # canonical text form (compressed for IPv6)
    dst: str
    sport: int | None = None
    dport: int | None = None
    icmp_type: int | None = None
    icmp_code: int | None = None
    tcp_flags: int | None = None  # e.g. 0x02 SYN
    payload: bytes = b""  # UDP or TCP payload as captured; empty for everything else
    seq: int | None = None  # TCP: the sequence number of the payload's first byte
    fragment: bool = False  # part of a fragmented datagram
    truncated: bool = False  # captured bytes are fewer than the IP length says

    @property
    def proto_number(self) -> int:
        if isinstance(self.proto, int):
            return self.proto
        return PROTO_NUMBERS[self.proto]

    def flow(self) -> Flow:
        """The model's 5-tuple; for ICMP the "ports" are type and code."""
        if self.icmp_type is not None:
            return Flow(str(self.proto), self.src, self.dst, self.icmp_type, self.icmp_code)
        return Flow(str(self.proto), self.src, self.dst, self.sport, self.dport)


@dataclass(frozen=True)
class _L3:
    family: int
    proto: int
    src: str
    dst: str
    l4: bytes  # bytes after the IP headers, cut to the IP length
    first_fragment: bool  # the L4 header is present (not a later fragment)
    fragment: bool
    truncated: bool


def parse_ip_packet(data: bytes) -> Packet | None:
    """The flow of one IPv4 or IPv6 packet, or None if the bytes do not parse."""
    if not data:
        return None
    version = data[0] >> 4
    l3 = _parse_v4(data) if version == 4 else _parse_v6(data) if version == 6 else None
    if l3 is None:
        return None
    return _with_transport(l3)


def _parse_v4(data: bytes) -> _L3 | None:
    if len(data) < 20:
        return None
    ihl = (data[0] & 0x0F) * 4
    total = struct.unpack_from("!H", data, 2)[0]
    if ihl < 20 or len(data) < ihl or total < ihl:
        return None
    frag = struct.unpack_from("!H", data, 6)[0]
    offset, more = frag & 0x1FFF, bool(frag & 0x2000)
    return _L3(
        family=4,
        proto=data[9],
        # the text str(IPv4Address(...)) gives, at a fifth of the cost (per held segment)
        src=f"{data[12]}.{data[13]}.{data[14]}.{data[15]}",
        dst=f"{data[16]}.{data[17]}.{data[18]}.{data[19]}",
        l4=data[ihl:total],
        first_fragment=offset == 0,
        fragment=more or offset != 0,
        truncated=len(data) < total,
    )


def _parse_v6(data: bytes) -> _L3 | None:
    if len(data) < 40:
        return None
    plen = struct.unpack_from("!H", data, 4)[0]
    end = 40 + plen if plen else len(data)  # 0: jumbogram, trust the capture
    chain = _walk_v6_extensions(data, data[6], 40, min(end, len(data)))
    if chain is None:
        return None
    proto, pos, first, fragment = chain
    return _L3(
        family=6,
        proto=proto,
        src=str(ipaddress.IPv6Address(data[8:24])),
        dst=str(ipaddress.IPv6Address(data[24:40])),
        l4=data[pos:end],
        first_fragment=first,
        fragment=fragment,
        truncated=len(data) < end,
    )


def _walk_v6_extensions(
    data: bytes, nxt: int, pos: int, end: int
) -> tuple[int, int, bool, bool] | None:
    """Skip extension headers: (transport proto, its offset, first fragment?, fragment?)."""
    first, fragment = True, False
    for _ in range(_MAX_EXT_HEADERS):
        if nxt not in _V6_EXT_GENERIC and nxt not in (_V6_FRAGMENT, _V6_AH):
            return nxt, pos, first, fragment
        if pos + 8 > end:
            return None
        if nxt == _V6_FRAGMENT:
            frag = struct.unpack_from("!H", data, pos + 2)[0]
            first, fragment = (frag & 0xFFF8) == 0, True
            size = 8
        elif nxt == _V6_AH:
            size = (data[pos + 1] + 2) * 4
        else:
            size = (data[pos + 1] + 1) * 8
        nxt, pos = data[pos], pos + size
    return None  # absurdly long chain: treat as garbage


def _with_transport(l3: _L3) -> Packet | None:
    if l3.first_fragment and l3.proto == 6:
        return _tcp(l3)  # built whole: the first-bytes check parses every held segment
    if l3.first_fragment and l3.proto == 17:
        return _udp(l3)  # and the observer every DNS query
    base = Packet(
        family=l3.family,
        proto=PROTO_NAMES.get(l3.proto, l3.proto),
        src=l3.src,
        dst=l3.dst,
        fragment=l3.fragment,
        truncated=l3.truncated,
    )
    if not l3.first_fragment:
        return base
    if (l3.proto, l3.family) in ((1, 4), (58, 6)):
        return _icmp(base, l3.l4)
    return base


def _tcp(l3: _L3) -> Packet | None:
    seg = l3.l4
    if len(seg) < 20:
        return None
    sport, dport, seq = struct.unpack_from("!HHI", seg, 0)
    start = (seg[12] >> 4) * 4
    payload = seg[start:] if start >= 20 else b""  # a data offset under 5 words is bogus
    return Packet(l3.family, "tcp", l3.src, l3.dst, sport, dport, None, None, seg[13], payload,
                  seq, l3.fragment, l3.truncated)  # fmt: skip


def _udp(l3: _L3) -> Packet | None:
    seg = l3.l4
    if len(seg) < 8:
        return None
    sport, dport, length = struct.unpack_from("!HHH", seg, 0)
    if length and length < 8:
        return None
    payload = seg[8:length] if length else seg[8:]
    return Packet(l3.family, "udp", l3.src, l3.dst, sport, dport, None, None, None, payload,
                  None, l3.fragment, l3.truncated)  # fmt: skip


def _icmp(base: Packet, seg: bytes) -> Packet | None:
    if len(seg) < 4:
        return None
    return replace(base, icmp_type=seg[0], icmp_code=seg[1])
