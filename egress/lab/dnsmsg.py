"""Reading DNS packets by hand, for the bytes dnslib refuses.

The lab must log every query and relay tunnel zones without a full parse: iodine's probes
carry non-LDH, 255-character names and odd types that dnslib rejects, and a tunnel server
must receive them byte for byte. So the header and the first question are read here, and
error replies are built from the raw header, never from a parsed record.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

HEADER_LEN = 12
_MAX_POINTERS = 16  # more compression hops than any honest question needs
RCODE_FORMERR = 1
RCODE_SERVFAIL = 2
RCODE_NOTIMP = 4
RCODE_REFUSED = 5


@dataclass(frozen=True)
class RawQuestion:
    """The first question of a packet, as sent (case and odd bytes preserved)."""

    labels: tuple[bytes, ...]
    qtype: int
    qclass: int
    end: int  # offset just past the question in the packet

    @property
    def name(self) -> str:
        """Labels joined by '.', latin-1 decoded so every byte maps to one character."""
        return ".".join(label.decode("latin-1") for label in self.labels)

    @property
    def key(self) -> str:
        """Lower-case fqdn form used to pick a zone or relay (ASCII case only, RFC 4343)."""
        return (self.name.translate(_ASCII_LOWER) + ".") if self.labels else "."


_ASCII_LOWER = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}


def header(packet: bytes) -> tuple[int, int, int] | None:
    """(id, flags, qdcount), or None for fewer than 12 bytes."""
    if len(packet) < HEADER_LEN:
        return None
    ident, flags, qdcount = struct.unpack_from("!HHH", packet)
    return ident, flags, qdcount


def is_response(packet: bytes) -> bool:
    """QR bit set: never answer these, or two servers could echo each other forever."""
    return len(packet) >= 3 and bool(packet[2] & 0x80)


def opcode(packet: bytes) -> int:
    return (packet[2] >> 3) & 0x0F if len(packet) >= 3 else 0


def parse_question(packet: bytes) -> RawQuestion | None:
    """Read the first question by hand; None if the packet has none or it is malformed."""
    head = header(packet)
    if head is None or head[2] < 1:
        return None
    parsed = _read_name(packet, HEADER_LEN)
    if parsed is None:
        return None
    labels, offset = parsed
    if offset + 4 > len(packet):
        return None
    qtype, qclass = struct.unpack_from("!HH", packet, offset)
    return RawQuestion(labels, qtype, qclass, offset + 4)


def _read_name(packet: bytes, offset: int) -> tuple[tuple[bytes, ...], int] | None:
    labels: list[bytes] = []
    end: int | None = None  # where the name ends in the packet, before any pointer jump
    hops = 0
    while offset < len(packet):
        length = packet[offset]
        if length == 0:
            return tuple(labels), (end if end is not None else offset + 1)
        if length & 0xC0 == 0xC0:
            if offset + 1 >= len(packet) or hops >= _MAX_POINTERS:
                return None
            if end is None:
                end = offset + 2
            offset = ((length & 0x3F) << 8) | packet[offset + 1]
            hops += 1
            continue
        if length & 0xC0:
            return None  # 0x40/0x80 label types are obsolete or unassigned
        label = packet[offset + 1 : offset + 1 + length]
        if len(label) != length:
            return None
        labels.append(label)
        offset += 1 + length
    return None


def error_reply(packet: bytes, rcode: int, question: RawQuestion | None = None) -> bytes | None:
    """A header-only reply (plus the question, if known) carrying ``rcode``.

    Built from raw bytes so that even a packet no parser accepts gets a FORMERR, which
    tells a client "your packet was bad" instead of making it time out.
    """
    head = header(packet)
    if head is None:
        return None
    ident, flags, _ = head
    # Keep opcode and RD from the query; set QR; clear AA, TC, RA, Z and the old rcode.
    out_flags = 0x8000 | (flags & 0x7900) | (rcode & 0x0F)
    qd = packet[HEADER_LEN : question.end] if question is not None else b""
    return struct.pack("!HHHHHH", ident, out_flags, 1 if qd else 0, 0, 0, 0) + qd
