"""DNS wire format on the hot path: header, question, EDNS and TTL patching by hand.

dnslib parses and packs whole messages; doing that per query costs ~70 µs. Queries only
need the header and the one question, and cached answers only need their ID and TTLs
patched, so those paths work on bytes here and leave dnslib to the cache-miss path.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from egress.errors import WireError

__all__ = ["WireError"]  # raised here; defined with every other error in egress.errors

HEADER = struct.Struct("!HHHHHH")
QR = 0x8000
OPCODE_MASK = 0x7800
AA = 0x0400
TC = 0x0200
RD = 0x0100
RA = 0x0080
AD = 0x0020
CD = 0x0010

NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
TYPE_OPT = 41
CLASS_IN = 1
MAX_UDP_NO_EDNS = 512
_PLAIN_BYTES = b"abcdefghijklmnopqrstuvwxyz0123456789-_*"
_PLAIN = frozenset(_PLAIN_BYTES)
_LOWER = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"abcdefghijklmnopqrstuvwxyz")
OUR_EDNS_SIZE = 1232  # the DNS flag day 2020 size: no IP fragmentation


@dataclass(frozen=True, slots=True)
class Query:
    id: int
    flags: int
    qname: str  # lowercase, no trailing dot ("" for the root)
    qtype: int
    qclass: int
    question: bytes  # the client's question section as sent (its letter case kept)
    key: bytes  # lowercased question section: the cache key, with qtype and qclass
    edns_size: int | None  # the client's EDNS UDP size, None without OPT
    raw_labels: tuple[bytes, ...]  # labels as sent, for the tunnel scorer

    @property
    def rd(self) -> bool:
        return bool(self.flags & RD)


def parse_query(data: bytes) -> Query:
    """Header and question of a query; raises WireError on anything else."""
    if len(data) < HEADER.size:
        raise WireError("shorter than a DNS header", None)
    qid, flags, qd, an, ns, ar = HEADER.unpack_from(data)
    if flags & QR:
        raise WireError("a response, not a query", None)
    if flags & OPCODE_MASK:
        raise WireError(f"opcode {(flags & OPCODE_MASK) >> 11} is not QUERY", NOTIMP)
    if qd != 1:
        raise WireError(f"{qd} questions; exactly one is answered", FORMERR)
    if an or ns:
        raise WireError("a query with answer or authority records", FORMERR)
    labels, end = _read_labels(data, HEADER.size)
    if end + 4 > len(data):
        raise WireError("question cut short", FORMERR)
    qtype, qclass = struct.unpack_from("!HH", data, end)
    question = bytes(data[HEADER.size : end + 4])
    edns = _read_edns(data, end + 4, ar)
    qname = name_text(labels)
    key = question.lower()
    return Query(qid, flags, qname, qtype, qclass, question, key, edns, labels)


def one_plain_query(data: bytes, q: Query) -> bool:
    """``data`` (which parsed as ``q``) is exactly one query as stubs send it: header,
    question, and nothing after but one OPT record. Several queries sent at once with
    UDP GSO (``UDP_SEGMENT``) reach a packet filter as one packet, which parses as its
    first query; the resolver's socket receives each one. So does anything after the
    question that is not one whole OPT record (a count of two records, a record that
    ends early or late): only this shape can be judged by its first query alone."""
    end = HEADER.size + len(q.question)
    arcount = struct.unpack_from("!H", data, 10)[0]
    if arcount == 0:
        return end == len(data)
    if arcount != 1 or end + 11 > len(data) or data[end] != 0:
        return False
    rtype: int = struct.unpack_from("!H", data, end + 1)[0]
    rdlen: int = struct.unpack_from("!H", data, end + 9)[0]
    return rtype == TYPE_OPT and end + 11 + rdlen == len(data)


def label_text(label: bytes) -> str:
    """A label as lowercase text; a byte outside letters, digits, ``-``, ``_`` and ``*``
    becomes ``\\DDD`` (a dot inside a label too), so no label can pose as two."""
    label = label.translate(_LOWER)
    if not label.translate(None, _PLAIN_BYTES):
        return label.decode("ascii")
    return "".join(chr(b) if b in _PLAIN else f"\\{b:03d}" for b in label)


def name_text(labels: list[bytes] | tuple[bytes, ...]) -> str:
    return ".".join([label_text(label) for label in labels])


def is_hostname(name: str) -> bool:
    """Only letters, digits, ``-`` and ``_`` in its labels (what name_text left plain)."""
    return "\\" not in name and "*" not in name


def hostname_shape(name: str) -> str:
    """``name`` with each label that is not a hostname label replaced by ``x``: where the
    name falls in the allowlist, whatever bytes it carries."""
    return ".".join("x" if ("\\" in lab or "*" in lab) else lab for lab in name.split("."))


@dataclass(frozen=True, slots=True)
class BinaryName:
    """A name under an allowed rule that carries bytes no hostname has: only data does."""

    name: str
    rule: str

    def describe(self) -> str:
        return (f"non-hostname bytes in a name under {self.rule}: no host is named so, "
                "a DNS tunnel's data is")  # fmt: skip


def _read_labels(data: bytes, pos: int) -> tuple[tuple[bytes, ...], int]:
    labels: list[bytes] = []
    total = 0
    while True:
        if pos >= len(data):
            raise WireError("question name cut short", FORMERR)
        n = data[pos]
        if n == 0:
            return tuple(labels), pos + 1
        if n & 0xC0:
            # A query's only name comes first: there is nothing earlier to point at.
            raise WireError("compression or extended label in a query name", FORMERR)
        label = data[pos + 1 : pos + 1 + n]
        if len(label) != n:
            raise WireError("question name cut short", FORMERR)
        total += n + 1
        if total > 254:
            raise WireError("name longer than 255 bytes", FORMERR)
        labels.append(label)
        pos += 1 + n


def _read_edns(data: bytes, pos: int, arcount: int) -> int | None:
    """The client's EDNS UDP payload size from its OPT record, if it sent one."""
    if arcount == 0:
        return None
    # One OPT with the root name is what stubs send; anything else is parsed no further.
    if pos + 11 <= len(data) and data[pos] == 0:
        rtype, size = struct.unpack_from("!HH", data, pos + 1)
        if rtype == TYPE_OPT:
            return max(int(size), MAX_UDP_NO_EDNS)
    return None


def reply_flags(query_flags: int, rcode: int) -> int:
    """Flags of our reply: QR, RA, the client's RD and CD, and the rcode."""
    return QR | RA | (query_flags & (RD | CD)) | (rcode & 0xF)


def error_reply(query: Query, rcode: int, ede: bytes = b"") -> bytes:
    """A reply carrying only the question and ``rcode`` (REFUSED, NXDOMAIN, SERVFAIL...);
    ``ede``: an Extended DNS Error option (``ede_option``) for a client that sent EDNS
    (one that did not may not get an OPT record back, RFC 6891)."""
    opt = query.edns_size is not None
    head = HEADER.pack(query.id, reply_flags(query.flags, rcode), 1, 0, 0, 1 if opt else 0)
    return head + query.question + (opt_record(options=ede) if opt else b"")


def header_error(data: bytes, rcode: int) -> bytes | None:
    """FORMERR/NOTIMP for a packet we could not parse past its header."""
    if len(data) < HEADER.size:
        return None
    qid, flags = struct.unpack_from("!HH", data)
    return HEADER.pack(qid, reply_flags(flags, rcode), 0, 0, 0, 0)


def opt_record(size: int = OUR_EDNS_SIZE, options: bytes = b"") -> bytes:
    """An OPT pseudo-record: root name, type 41, class = UDP size, then ``options``."""
    return b"\x00" + struct.pack("!HHIH", TYPE_OPT, size, 0, len(options)) + options


EDE_OPTION = 15  # the EDNS option code of an Extended DNS Error (RFC 8914)
EDE_BLOCKED = 15  # "the resolver has blocked the domain ... due to internal policy"
EDE_MAX_TEXT = 200  # bytes of text: a denial's reason, not a document


def ede_option(code: int, text: str) -> bytes:
    """The EDE option: info code, then its UTF-8 text (cut at ``EDE_MAX_TEXT`` bytes)."""
    data = text.encode("utf-8")[:EDE_MAX_TEXT].decode("utf-8", "ignore").encode("utf-8")
    return struct.pack("!HHH", EDE_OPTION, 2 + len(data), code) + data


def build_query(qid: int, qname: str, qtype: int) -> bytes:
    """Our own upstream query: our ID, the lowercased name, RD, our EDNS and nothing else."""
    head = HEADER.pack(qid, RD, 1, 0, 0, 1)
    return head + encode_name(qname) + struct.pack("!HH", qtype, CLASS_IN) + opt_record()


def encode_name(name: str) -> bytes:
    """Wire form of a name as name_text wrote it (``\\DDD`` escapes undone)."""
    if not name:
        return b"\x00"
    out = bytearray()
    for label in name.split("."):
        raw = _unescape(label) if "\\" in label else label.encode("ascii")
        out.append(len(raw))
        out += raw
    out.append(0)
    return bytes(out)


def _unescape(label: str) -> bytes:
    out = bytearray()
    i = 0
    while i < len(label):
        if label[i] == "\\":
            out.append(int(label[i + 1 : i + 4]))
            i += 4
        else:
            out.append(ord(label[i]))
            i += 1
    return bytes(out)


def skip_name(data: bytes, pos: int) -> int:
    """Offset just past a (possibly compressed) name; raises WireError if malformed."""
    for _ in range(128):
        if pos >= len(data):
            raise WireError("name runs past the message", FORMERR)
        n = data[pos]
        if n == 0:
            return pos + 1
        if n & 0xC0 == 0xC0:
            return pos + 2
        if n & 0xC0:
            raise WireError("extended label type", FORMERR)
        pos += 1 + n
    raise WireError("name has too many labels", FORMERR)


def ttl_offsets(message: bytes) -> list[int]:
    """Offsets of every TTL field outside the question, skipping OPT (its 'TTL' is flags)."""
    _, _, qd, an, ns, ar = HEADER.unpack_from(message)
    pos = HEADER.size
    for _ in range(qd):
        pos = skip_name(message, pos) + 4
    offsets = []
    for _ in range(an + ns + ar):
        pos = skip_name(message, pos)
        rtype, _, _, rdlen = struct.unpack_from("!HHIH", message, pos)
        if rtype != TYPE_OPT:
            offsets.append(pos + 4)
        pos += 10 + rdlen
    if pos > len(message):
        raise WireError("records run past the message", FORMERR)
    return offsets
