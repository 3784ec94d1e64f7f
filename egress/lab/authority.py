"""Authoritative answers for the lab zones: no sockets, so unit tests call it directly.

It behaves like a small real authoritative server because the resolver under test must
meet real behaviour: AA set, RA clear; CNAME chains followed inside the lab's zones; NXDOMAIN
and NODATA carry the zone's SOA in the authority section with the RFC 2308 negative TTL (so
resolvers can cache negatives); names outside every zone are REFUSED; UDP answers larger
than the client's buffer (512 bytes without EDNS) are truncated with TC=1 so the client
retries over TCP.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from typing import Any

from dnslib import CLASS, EDNS0, OPCODE, QTYPE, RCODE, RR, A, DNSHeader, DNSRecord

from egress.lab.dnsmsg import HEADER_LEN, RawQuestion
from egress.lab.topology import ANY4, ANY_ZONE
from egress.lab.zones import Node, Relay, RRSet, Zone, ZoneSet, fqdn

MAX_CHAIN = 8  # CNAME hops followed before giving up (loops end here too)
NO_EDNS_UDP = 512
QCLASS_ANY = 255  # dnslib names it "*" and cannot look that up by attribute
OUR_EDNS_UDP = 1232  # the DNS flag day 2020 default: no IP fragmentation


@dataclass(frozen=True)
class Answer:
    """A reply and how long to hold it back (zone ``delay``) before sending."""

    reply: Any  # dnslib.DNSRecord
    delay: float = 0.0


def answer(zones: ZoneSet, request: Any) -> Answer:
    """Answer a parsed query (a dnslib ``DNSRecord``) from ``zones``."""
    if request.header.opcode != OPCODE.QUERY:
        return Answer(_reply(request, RCODE.NOTIMP, aa=False))
    if len(request.questions) != 1:
        return Answer(_reply(request, RCODE.FORMERR, aa=False))
    question = request.q
    if question.qclass not in (CLASS.IN, QCLASS_ANY):
        return Answer(_reply(request, RCODE.REFUSED, aa=False))
    qname = fqdn(str(question.qname))
    zone = zones.route(qname)
    if not isinstance(zone, Zone):
        # A relay zone only reaches here if the raw relay was bypassed; refuse, never guess.
        return Answer(_reply(request, RCODE.REFUSED, aa=False))
    return _resolve(zones, zone, request, qname, question.qtype)


def synthesized(qname: str) -> str | None:
    """``ip-198-19-A-B.any.lab.test.`` -> ``198.19.A.B``: one name per AnyIP address."""
    label, _, rest = qname.partition(".")
    if rest.rstrip(".") != ANY_ZONE or not label.startswith("ip-"):
        return None
    try:
        addr = ipaddress.IPv4Address(label[3:].replace("-", "."))
    except ValueError:
        return None
    return str(addr) if addr in ipaddress.IPv4Network(ANY4) else None


# A query's flags kept in the reply (opcode, RD, CD), as _reply keeps them; QR and AA set.
_KEPT_FLAGS, _REPLY_FLAGS = 0x7800 | 0x0100 | 0x0010, 0x8000 | 0x0400
_OPT, _SYNTH_TTL = 41, 300
# The answer: its owner (a pointer to the question's name), type, class, TTL, length
_ANSWER = struct.Struct("!HHHIH")
_OUR_OPT = b"\0" + struct.pack("!HHIH", _OPT, OUR_EDNS_UDP, 0, 0)


def quick_answer(zones: ZoneSet, packet: bytes, question: RawQuestion) -> bytes | None:
    """The reply to a plain UDP query for the A record of a synthesized name, built from
    its bytes: the bytes ``encode(answer(...))`` makes of it (test_lab_quick_answer.py
    holds them to that). None for anything else, answered through dnslib.

    bench_egressd asks 1,000 such names a second of the lab, each a miss of egressd's;
    through dnslib the lab's DNS took 30% of a CPU for them, on the 2 vCPUs egressd and
    its observer layer share with it, and with no real upstream on the node."""
    if len(packet) < HEADER_LEN or question.qtype != QTYPE.A or question.qclass != CLASS.IN:
        return None
    ident, flags, qd, an, ns, ar = struct.unpack_from("!6H", packet)
    if flags & 0xF800 or qd != 1 or an or ns or ar > 1:
        return None  # a response, another opcode, or sections dnslib must read
    if question.end != HEADER_LEN + sum(len(label) + 1 for label in question.labels) + 5:
        return None  # a compression pointer in the name: dnslib re-encodes it, left to it
    if any(b"." in label for label in question.labels):
        return None  # its key reads as more labels than it has: dnslib's owner name differs
    opt = b""
    if ar:
        # One OPT record, alone and whole: the client's buffer size says nothing here (a
        # reply this small is never truncated), but the reply then carries ours.
        end = question.end
        if packet[end : end + 3] != b"\0\0\x29" or len(packet) < end + 11:
            return None
        if not _options_fill(
            packet, end + 11, end + 11 + struct.unpack_from("!H", packet, end + 9)[0]
        ):
            return None
        opt = _OUR_OPT
    elif len(packet) != question.end:
        return None
    key = question.key
    address = synthesized(key)
    if address is None or not isinstance(zones.route(key), Zone):
        return None
    head = struct.pack("!6H", ident, (flags & _KEPT_FLAGS) | _REPLY_FLAGS, 1, 1, 0, 1 if opt else 0)
    answer_rr = _ANSWER.pack(0xC000 | HEADER_LEN, QTYPE.A, CLASS.IN, _SYNTH_TTL, 4)
    return (
        head + packet[HEADER_LEN : question.end] + answer_rr
        + ipaddress.IPv4Address(address).packed + opt
    )  # fmt: skip


def _options_fill(packet: bytes, start: int, end: int) -> bool:
    """The OPT record's options (code, length, data) fill it to ``end``, and it ends the
    packet: anything else is left to dnslib, whatever it makes of it."""
    if end != len(packet):
        return False
    while start < end:
        if start + 4 > end:
            return False
        start += 4 + struct.unpack_from("!H", packet, start + 2)[0]
    return start == end


def _resolve(zones: ZoneSet, zone: Zone, request: Any, qname: str, qtype: int) -> Answer:
    reply = _reply(request, RCODE.NOERROR, aa=True)
    synth = synthesized(qname)
    if synth is not None:
        if qtype == QTYPE.A:
            reply.add_answer(RR(str(request.q.qname), QTYPE.A, CLASS.IN, _SYNTH_TTL, A(synth)))
        else:
            _add_soa(reply, zone)
        return Answer(reply)
    owner = str(request.q.qname)  # echo the asker's spelling of the first owner name
    delay = 0.0
    for _ in range(MAX_CHAIN):
        node = zone.lookup(qname)
        if node is None:
            reply.header.rcode = RCODE.NXDOMAIN
            _add_soa(reply, zone)
            return Answer(reply, delay)
        delay = max(delay, node.delay)
        cname = node.rrsets.get(QTYPE.CNAME)
        if cname is None or qtype in (QTYPE.CNAME, QTYPE.ANY):
            if not _add_data(reply, node, owner, qtype):
                _add_soa(reply, zone)  # NODATA: NOERROR, empty answer, SOA (RFC 2308 s2.2)
            return Answer(reply, delay)
        _add_rrset(reply, owner, cname)
        qname = owner = fqdn(str(cname.rdatas[0].label))
        next_zone = zones.route(qname)
        if not isinstance(next_zone, Zone):
            return Answer(reply, delay)  # target outside our zones: the resolver chases it
        zone = next_zone
    return Answer(reply, delay)


def _add_data(reply: Any, node: Node, owner: str, qtype: int) -> bool:
    if qtype == QTYPE.ANY:
        for rrset in node.rrsets.values():
            _add_rrset(reply, owner, rrset)
        return bool(node.rrsets)
    found = node.rrsets.get(qtype)
    if found is None:
        return False
    _add_rrset(reply, owner, found)
    return True


def _add_rrset(reply: Any, owner: str, rrset: RRSet) -> None:
    for rdata in rrset.rdatas:
        reply.add_answer(RR(owner, rrset.rtype, CLASS.IN, rrset.ttl, rdata))


def _add_soa(reply: Any, zone: Zone) -> None:
    soa = zone.soa.rdatas[0]
    reply.add_auth(RR(zone.origin, QTYPE.SOA, CLASS.IN, zone.negative_ttl, soa))


def _reply(request: Any, rcode: int, *, aa: bool) -> Any:
    # An authoritative-only server offers no recursion: RA stays clear.
    head = DNSHeader(id=request.header.id, bitmap=request.header.bitmap, qr=1, aa=int(aa), ra=0)
    head.tc = head.ad = head.z = 0
    head.rcode = rcode
    return DNSRecord(head, q=request.q if request.questions else None)


def client_udp_size(request: Any) -> int | None:
    """The client's EDNS UDP buffer size, or None when it sent no OPT record."""
    for rr in request.ar:
        if rr.rtype == QTYPE.OPT:
            return max(NO_EDNS_UDP, int(rr.rclass))
    return None


def encode(result: Answer, request: Any, *, udp: bool) -> bytes:
    """Pack the reply; over UDP, truncate to the client's buffer and set TC."""
    reply = result.reply
    edns = client_udp_size(request)
    if edns is not None:
        reply.add_ar(EDNS0(udp_len=OUR_EDNS_UDP))
    data: bytes = reply.pack()
    limit = min(edns, OUR_EDNS_UDP) if edns is not None else NO_EDNS_UDP
    if not udp or len(data) <= limit:
        return data
    # Header and question only, TC=1: the client learns the answer exists and asks over TCP.
    head = DNSHeader(id=reply.header.id, bitmap=reply.header.bitmap, tc=1)
    short = DNSRecord(head, q=request.q)
    if edns is not None:
        short.add_ar(EDNS0(udp_len=OUR_EDNS_UDP))
    packed: bytes = short.pack()
    return packed


def is_relay(zones: ZoneSet, key: str) -> Relay | None:
    """The relay for a raw, lower-cased fqdn, if the longest match is a relay."""
    item = zones.route(key)
    return item if isinstance(item, Relay) else None
