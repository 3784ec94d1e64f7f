"""Upstream responses as plain records, read by hand, and the answers we cache, built by hand.

A cache miss used to parse the upstream's response with dnslib and pack the filtered answer
with it again: ~90 µs of the time a sandbox waits for an answer that also waits for the
kernel's set. Responses made of the records we understand (addresses, CNAME, SOA, NS, PTR,
MX, TXT, SVCB/HTTPS, OPT) are read here directly; any other type in the answer or
authority section falls back to dnslib (``message_dnslib``), which yields the same
``Record``s. Either way the filter sees one representation and ``build`` writes one wire
format.

Names are lowercase text without the trailing dot. A label byte outside letters, digits,
``-``, ``_`` and ``*`` is written ``\\DDD`` (a dot inside a label too), so no label can pose
as two and match a rule it is not.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from egress.resolver import wire

A, NS, CNAME, SOA, PTR, MX, TXT, AAAA = 1, 2, 5, 6, 12, 15, 16, 28
_NAME_TYPES = {NS: 0, CNAME: 0, PTR: 0, MX: 2}  # rdata = fixed prefix + one name
SVCB, HTTPS = 64, 65
# rdata copied as is (0: any length); SVCB's TargetName is never compressed (RFC 9460 2.2)
_RAW_TYPES = {A: 4, AAAA: 16, TXT: 0, SVCB: 0, HTTPS: 0}
_RR = struct.Struct("!HHIH")
name_text = wire.name_text


@dataclass(slots=True)
class Record:
    name: str
    rtype: int
    rclass: int
    ttl: int
    rdata: bytes  # wire form with every name in it uncompressed
    target: str = ""  # CNAME: the name it points at

    def soa_minimum(self) -> int:
        return int(struct.unpack_from("!I", self.rdata, len(self.rdata) - 4)[0])


@dataclass(slots=True)
class Response:
    id: int
    flags: int
    questions: list[tuple[str, int, int]]  # (name, type, class)
    answers: list[Record]
    authority: list[Record]

    @property
    def rcode(self) -> int:
        return self.flags & 0xF

    @property
    def truncated(self) -> bool:
        return bool(self.flags & wire.TC)


class Unsupported(Exception):
    """A record this reader leaves to dnslib."""


def read_name(data: bytes, pos: int) -> tuple[list[bytes], int]:
    """Labels of the (possibly compressed) name at ``pos`` and the offset just past it.
    Pointers must point backwards, so a loop cannot be built; WireError if malformed."""
    labels: list[bytes] = []
    end = -1
    total = 0
    limit = pos
    while True:
        if pos >= len(data):
            raise wire.WireError("name runs past the message", wire.FORMERR)
        n = data[pos]
        if n & 0xC0 == 0xC0:
            if pos + 1 >= len(data):
                raise wire.WireError("pointer cut short", wire.FORMERR)
            target = ((n & 0x3F) << 8) | data[pos + 1]
            if target >= limit:
                raise wire.WireError("compression pointer does not point backwards", wire.FORMERR)
            if end < 0:
                end = pos + 2
            pos = limit = target
            continue
        if n & 0xC0:
            raise wire.WireError("extended label type", wire.FORMERR)
        if n == 0:
            return labels, (end if end >= 0 else pos + 1)
        total += n + 1
        if total > 254 or pos + 1 + n > len(data):
            raise wire.WireError("name too long or cut short", wire.FORMERR)
        labels.append(data[pos + 1 : pos + 1 + n])
        pos += 1 + n


def encode_labels(labels: list[bytes]) -> bytes:
    return b"".join(bytes((len(label),)) + label for label in labels) + b"\x00"


def parse(data: bytes) -> Response:
    """The response, or WireError (garbage) / Unsupported (ask dnslib)."""
    data = bytes(data)  # a bytearray's slices would be bytearrays too
    if len(data) < wire.HEADER.size:
        raise wire.WireError("shorter than a DNS header", None)
    qid, flags, qd, an, ns, ar = wire.HEADER.unpack_from(data)
    pos = wire.HEADER.size
    questions = []
    for _ in range(qd):
        labels, pos = read_name(data, pos)
        if pos + 4 > len(data):
            raise wire.WireError("question cut short", wire.FORMERR)
        qtype, qclass = struct.unpack_from("!HH", data, pos)
        questions.append((name_text(labels), qtype, qclass))
        pos += 4
    if flags & wire.TC:  # the records may be cut off: only the header and question count
        return Response(qid, flags, questions, [], [])
    answers, pos = _records(data, pos, an)
    authority, pos = _records(data, pos, ns, skip=(NS,))
    _, pos = _records(data, pos, ar, skip=None)
    return Response(qid, flags, questions, answers, authority)


def _records(
    data: bytes, pos: int, count: int, skip: tuple[int, ...] | None = ()
) -> tuple[list[Record], int]:
    """``count`` records from ``pos``; types in ``skip`` (every type for None) are
    checked for structure only and left out."""
    out = []
    for _ in range(count):
        labels, pos = read_name(data, pos)
        if pos + 10 > len(data):
            raise wire.WireError("record cut short", wire.FORMERR)
        rtype, rclass, ttl, rdlen = _RR.unpack_from(data, pos)
        start, pos = pos + 10, pos + 10 + rdlen
        if pos > len(data):
            raise wire.WireError("rdata runs past the message", wire.FORMERR)
        if skip is None or rtype in skip:
            continue
        rec = _record(data, start, pos, rtype)
        rec.name, rec.rclass, rec.ttl = name_text(labels), rclass, ttl
        out.append(rec)
    return out, pos


def _record(data: bytes, start: int, end: int, rtype: int) -> Record:
    size = _RAW_TYPES.get(rtype)
    if size is not None:
        if size and end - start != size:
            raise wire.WireError(f"type {rtype} rdata of {end - start} bytes", wire.FORMERR)
        return Record("", rtype, 0, 0, data[start:end])
    prefix = _NAME_TYPES.get(rtype)
    if prefix is not None:
        labels, stop = read_name(data, start + prefix)
        if stop != end:
            raise wire.WireError("rdata length does not match its name", wire.FORMERR)
        target = name_text(labels) if rtype == CNAME else ""
        return Record("", rtype, 0, 0, data[start : start + prefix] + encode_labels(labels), target)
    if rtype == SOA:
        mname, pos = read_name(data, start)
        rname, pos = read_name(data, pos)
        if pos + 20 != end:
            raise wire.WireError("SOA rdata length", wire.FORMERR)
        return Record("", SOA, 0, 0, encode_labels(mname) + encode_labels(rname) + data[pos:end])
    raise Unsupported(rtype)


def build(
    qname: str, qtype: int, rcode: int, answers: list[Record], authority: list[Record]
) -> tuple[bytes, list[int]]:
    """Our answer with ID 0 and the lowercased question; and the offsets of its TTLs.
    Owner names repeated from the question or an earlier record are compressed."""
    out = bytearray(wire.HEADER.pack(0, wire.QR | wire.RD | wire.RA | rcode, 1,
                                     len(answers), len(authority), 0))  # fmt: skip
    names = {qname: wire.HEADER.size}
    out += wire.encode_name(qname) + struct.pack("!HH", qtype, wire.CLASS_IN)
    offsets = []
    for rec in (*answers, *authority):
        at = names.get(rec.name)
        if at is None:
            if len(out) < 0x3FFF:  # a pointer holds 14 bits of offset
                names[rec.name] = len(out)
            out += wire.encode_name(rec.name)
        else:
            out += struct.pack("!H", 0xC000 | at)
        offsets.append(len(out) + 4)
        out += _RR.pack(rec.rtype, rec.rclass, rec.ttl, len(rec.rdata)) + rec.rdata
    return bytes(out), offsets
