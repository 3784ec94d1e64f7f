"""Copy nf_tables tables from one netns into others, as one raw netlink batch.

queue_rule.py's rule is iptables-nft's (nft_compat's xt matches and NFQUEUE target, which
nft's own syntax cannot write), and each iptables-nft exec costs 3-7 ms of a create. So
the rule is made by iptables-nft once per process; ``capture`` reads back what it made
(the tables, their chains and rules, as the kernel dumps them) and ``apply`` sends the
same objects to each new netns in one transaction: what iptables-nft would have written,
without the exec. Left out is what identifies an object in the netns it was read from
(handles, use counts, ids, positions) and what is not the tool's to say (a table's owner,
chain counters); the rest goes as the kernel dumped it, the rule's counter expression with
the counts it had when read (none: it is read before the netns has any traffic).
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from egress.kernel.netns import in_netns
from egress.kernel.nfnetlink import HDR, NETLINK_NETFILTER, NFGEN, message

_SUBSYS = 10  # NFNL_SUBSYS_NFTABLES
NEWTABLE, GETTABLE, NEWCHAIN, GETCHAIN, NEWRULE, GETRULE = 0, 1, 3, 4, 6, 7
_BATCH_BEGIN, _BATCH_END, _ERROR, _DONE = 0x10, 0x11, 2, 3
_REQUEST, _ACK, _DUMP, _CREATE, _APPEND = 0x1, 0x4, 0x300, 0x400, 0x800
# Attributes kept per object (linux/netfilter/nf_tables.h): table NAME FLAGS USERDATA;
# chain TABLE NAME HOOK POLICY TYPE FLAGS USERDATA; rule TABLE CHAIN EXPRESSIONS USERDATA.
# Left out: handles, USE, PAD, ids, positions, the table's owner, chain counters.
_KEEP = {NEWTABLE: {1, 2, 6}, NEWCHAIN: {1, 3, 4, 5, 7, 10, 12}, NEWRULE: {1, 2, 4, 7}}
_TABLE_FLAGS, _RULE_EXPRESSIONS = 2, 4
_TABLE_ATTR = {NEWTABLE: 1, NEWCHAIN: 1, NEWRULE: 1}  # where each names its table
_FLAGS = {NEWTABLE: _CREATE, NEWCHAIN: _CREATE, NEWRULE: _CREATE | _APPEND}


@dataclass(frozen=True)
class Copy:
    """Objects to create, in order: (message type, family, attributes)."""

    objects: tuple[tuple[int, int, bytes], ...]

    def count(self, kind: int) -> int:
        return sum(1 for k, _, _ in self.objects if k == kind)

    def plain(self) -> bool:
        """Tables without flags (a dormant or owned table would not be what the tool made
        for itself: an owned one goes when ``apply``'s socket closes) and rules that all
        carry expressions (a dump read short would lose them)."""
        for kind, _, attrs in self.objects:
            found = dict(_attrs(attrs, 0, len(attrs)))
            if kind == NEWTABLE and found.get(_TABLE_FLAGS, b"\0" * 8)[4:8] != b"\0" * 4:
                return False
            if kind == NEWRULE and _RULE_EXPRESSIONS not in found:
                return False
        return True


def _socket(netns: str | None) -> socket.socket:
    with in_netns(netns):
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                             NETLINK_NETFILTER)  # fmt: skip
    try:
        sock.bind((0, 0))
        sock.settimeout(5.0)
    except OSError:
        sock.close()
        raise
    return sock


def _attrs(buf: bytes, pos: int, end: int) -> list[tuple[int, bytes]]:
    """(type without flags, the attribute's raw bytes, padded) in order."""
    out = []
    while pos + 4 <= end:
        length, kind = struct.unpack_from("=HH", buf, pos)
        if length < 4 or pos + length > end:
            break
        step = (length + 3) & ~3
        out.append((kind & 0x3FFF, bytes(buf[pos : pos + length]) + b"\0" * (step - length)))
        pos += step
    return out


def _replies(sock: socket.socket) -> Iterator[tuple[int, bytes, int, int]]:
    """Each message the kernel sends: (type, buffer, payload start, end); an ack or error
    yields its error code's start. Ends only when the caller stops."""
    while True:
        buf = sock.recv(1 << 16)
        pos = 0
        while pos + HDR.size <= len(buf):
            length, msg_type, _, _, _ = HDR.unpack_from(buf, pos)
            if length < HDR.size:
                raise OSError(0, "malformed nf_tables reply")
            yield msg_type, buf, pos + HDR.size, pos + length
            pos += (length + 3) & ~3


def _error(buf: bytes, start: int) -> int:
    return -int(struct.unpack_from("=i", buf, start)[0])


def _dump(sock: socket.socket, kind: int, family: int) -> list[list[tuple[int, bytes]]]:
    """Every object of one kind and family: its attributes."""
    sock.send(message((_SUBSYS << 8) | kind, _REQUEST | _DUMP, 1, family, 0, b""))
    found: list[list[tuple[int, bytes]]] = []
    for msg_type, buf, start, end in _replies(sock):
        if msg_type == _DONE:
            break
        if msg_type == _ERROR:
            code = _error(buf, start)
            raise OSError(code, os.strerror(code))
        found.append(_attrs(buf, start + NFGEN.size, end))
    return found


def capture(netns: str | None, families: tuple[int, ...], table: str) -> Copy:
    """What a netns holds of table ``table`` in each family (NFPROTO_IPV4 2, IPV6 10):
    the table, its chains and rules, in that order, as ``apply`` sends them."""
    name = table.encode() + b"\0"
    objects = []
    sock = _socket(netns)
    try:
        for family in families:
            for get, new in ((GETTABLE, NEWTABLE), (GETCHAIN, NEWCHAIN), (GETRULE, NEWRULE)):
                for attrs in _dump(sock, get, family):
                    if dict(attrs).get(_TABLE_ATTR[new], b"")[4 : 4 + len(name)] != name:
                        continue  # another table's
                    kept = b"".join(raw for kind, raw in attrs if kind in _KEEP[new])
                    objects.append((new, family, kept))
    finally:
        sock.close()
    return Copy(tuple(objects))


def apply(copy: Copy, netns: str | None) -> None:
    """Create ``copy``'s objects in ``netns`` in one transaction; OSError if the kernel
    refused any (then it made none of them)."""
    if not copy.objects:
        return
    batch = bytearray(message(_BATCH_BEGIN, _REQUEST, 1, 0, _SUBSYS, b""))
    for seq, (kind, family, attrs) in enumerate(copy.objects, start=2):
        batch += message(
            (_SUBSYS << 8) | kind, _REQUEST | _ACK | _FLAGS[kind], seq, family, 0, attrs
        )
    batch += message(_BATCH_END, _REQUEST, len(copy.objects) + 2, 0, _SUBSYS, b"")
    sock = _socket(netns)
    try:
        sock.send(batch)
        acked = 0
        for msg_type, buf, start, _ in _replies(sock):
            if msg_type != _ERROR:
                continue
            code = _error(buf, start)
            if code:  # the transaction is off: nothing of it was made
                raise OSError(code, os.strerror(code))
            acked += 1
            if acked == len(copy.objects):
                break
    finally:
        sock.close()
