"""Upstream responses through dnslib: the rare path, for record types ``message.parse``
does not read (``Unsupported``). It yields the same ``Record``s.

Kept apart from ``message`` so that module can be compiled (``native``): this one
subclasses dnslib's buffer, which compiled code cannot do inside a function, and it is
not on any hot path.
"""

from __future__ import annotations

import struct

from egress.resolver import wire
from egress.resolver.message import CNAME, NS, Record, Response, name_text

# What dnslib raises on bytes it cannot read (DNSError wraps its buffer errors; rdata it
# half-read shows up as the rest: a fuzz run of 300,000 mutated responses saw DNSError,
# UnicodeDecodeError and AttributeError).
# (dnslib is imported only here, on the rare path: it costs start-up time.)
READ_ERRORS = (UnicodeError, AttributeError, ValueError, IndexError, KeyError, TypeError,
               struct.error)  # fmt: skip


def from_dnslib(data: bytes) -> Response:
    """The same Response through dnslib, for record types ``parse`` does not read.
    WireError (rcode None) if dnslib cannot read it either."""
    from dnslib import DNSRecord
    from dnslib.dns import DNSError
    from dnslib.label import DNSBuffer

    class Flat(DNSBuffer):  # type: ignore[misc]
        def encode_name(self, name: object) -> None:  # positions differ once we rebuild
            self.encode_name_nocompress(name)

    def record(rr: object) -> Record:
        buf = Flat()
        rr.rdata.pack(buf)  # type: ignore[attr-defined]
        rec = Record(name_text(rr.rname.label), rr.rtype, rr.rclass, rr.ttl, bytes(buf.data))  # type: ignore[attr-defined]
        if rec.rtype == CNAME:
            rec.target = name_text(rr.rdata.label.label)  # type: ignore[attr-defined]
        return rec

    try:
        msg = DNSRecord.parse(data)
        h = msg.header
        flags = (h.qr << 15) | (h.opcode << 11) | (h.aa << 10) | (h.tc << 9) | (h.rd << 8)
        flags |= (h.ra << 7) | h.rcode
        questions = [(name_text(q.qname.label), q.qtype, q.qclass) for q in msg.questions]
        answers = [record(rr) for rr in msg.rr]
        authority = [record(rr) for rr in msg.auth if rr.rtype != NS]
    except (DNSError, *READ_ERRORS) as exc:  # translated here, once: callers handle WireError only
        raise wire.WireError(f"unreadable response: {type(exc).__name__}: {exc}", None) from None
    return Response(h.id, flags, questions, answers, authority)
