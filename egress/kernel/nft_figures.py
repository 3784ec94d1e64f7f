"""A sandbox's kernel figures for egressd's /metrics, read by raw nf_tables netlink: how
many elements a set holds, and a named counter's packets.

Through libnftables (egressd's one nft worker) the same figures took 2.6 ms a sandbox:
three round trips, each set listed whole as JSON to be counted. At 1,000 sandboxes a
scrape held the worker for 2.5 s, and a create waiting for it to load its rules waited
that long too. Here one socket in the sandbox's netns asks the kernel directly: a dump
per set, whose elements are counted, not decoded, and one GETOBJ. The kernel's dump
leaves out expired elements, as ``nft list set`` shows them. egressd reads them in a
process of its own (figures_worker.py), not on its loop's. An observer reads its sandbox's
drop counter, and its allow sets' elements at its start, the same way (observer/layer.py).
"""

from __future__ import annotations

import errno
import os
import socket
import struct

from egress.errors import DatapathError
from egress.kernel.netns import in_netns
from egress.kernel.nfnetlink import (
    NETLINK_NETFILTER,
    NFGEN,
    NLM_F_ACK,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    Answer,
    attr,
    exchange,
    iter_attrs,
    message,
)

TIMEOUT_S = 1.0  # the kernel answers in microseconds; this only bounds a wedged read
_SUBSYS = 10  # NFNL_SUBSYS_NFTABLES
_NEWSETELEM, _GETSETELEM = (_SUBSYS << 8) | 12, (_SUBSYS << 8) | 13
_NEWOBJ, _GETOBJ = (_SUBSYS << 8) | 18, (_SUBSYS << 8) | 19
DUMP_TRIES = 3  # then what the last dump held: the resolver adds elements all the time
_NFPROTO_INET = 1
_LIST_TABLE, _LIST_SET, _LIST_ELEMENTS = 1, 2, 3  # NFTA_SET_ELEM_LIST_*
_LIST_ELEM = 1  # NFTA_LIST_ELEM
_ELEM_KEY, _ELEM_EXPIRATION = 1, 5  # NFTA_SET_ELEM_*
_DATA_VALUE = 1  # NFTA_DATA_VALUE
_OBJ_TABLE, _OBJ_NAME, _OBJ_TYPE, _OBJ_DATA = 1, 2, 3, 4  # NFTA_OBJ_*
_OBJECT_COUNTER = 1  # NFT_OBJECT_COUNTER
_COUNTER_PACKETS = 2  # NFTA_COUNTER_PACKETS


class Reader:
    """One netlink socket in a sandbox's netns, for its figures (egressd's figures
    worker), or an observer's for its drop counter and its allow sets; close it when
    done."""

    def __init__(self, netns: str | None, table: str) -> None:
        try:
            with in_netns(netns):
                self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        except OSError as exc:
            raise DatapathError(f"nf_tables socket in netns {netns}: {exc.strerror}") from None
        try:
            self._sock.bind((0, 0))
            self._sock.settimeout(TIMEOUT_S)
        except OSError as exc:
            self._sock.close()
            raise DatapathError(f"nf_tables socket in netns {netns}: {exc.strerror}") from None
        self._table = table.encode() + b"\0"
        self._seq = 0
        self.interrupted = False

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def set_size(self, set_name: str) -> int:
        """How many live elements ``set_name`` (of the inet table) holds."""
        body = attr(_LIST_TABLE, self._table) + attr(_LIST_SET, set_name.encode() + b"\0")
        count = 0
        for kind, buf, start, end in self._ask(_GETSETELEM, NLM_F_DUMP, body, f"set {set_name}"):
            if kind != _NEWSETELEM:
                continue
            elements = iter_attrs(buf, start + NFGEN.size, end).get(_LIST_ELEMENTS, b"")
            count += _count(elements, _LIST_ELEM)
        return count

    def elements(self, set_name: str) -> list[tuple[bytes, float]]:
        """Each live element of ``set_name`` (of the inet table): its key's bytes (the
        fields of a concatenation each padded to 4 bytes, in the set's order) and the
        seconds it has left (0.0 without a timeout). A set that is not there: []."""
        body = attr(_LIST_TABLE, self._table) + attr(_LIST_SET, set_name.encode() + b"\0")
        for _ in range(DUMP_TRIES):  # a dump the ruleset changed under is asked again
            answer = self._ask(_GETSETELEM, NLM_F_DUMP, body, f"set {set_name}", True)
            if not self.interrupted:
                break
        out: list[tuple[bytes, float]] = []
        for kind, buf, start, end in answer:
            if kind != _NEWSETELEM:
                continue
            elements = iter_attrs(buf, start + NFGEN.size, end).get(_LIST_ELEMENTS, b"")
            for element in _each(elements, _LIST_ELEM):
                fields = iter_attrs(element, 0, len(element))
                nested = fields.get(_ELEM_KEY, b"")
                value = iter_attrs(nested, 0, len(nested)).get(_DATA_VALUE)
                if value is None:
                    continue
                expires = fields.get(_ELEM_EXPIRATION, b"")
                left = struct.unpack("!Q", expires)[0] / 1000 if len(expires) == 8 else 0.0
                out.append((value, left))
        return out

    def counter_packets(self, name: str) -> int:
        """The packets of the named counter object (of the inet table)."""
        body = attr(_OBJ_TABLE, self._table) + attr(_OBJ_NAME, name.encode() + b"\0")
        body += attr(_OBJ_TYPE, struct.pack("!I", _OBJECT_COUNTER))
        for kind, buf, start, end in self._ask(_GETOBJ, NLM_F_ACK, body, f"counter {name}"):
            if kind == _NEWOBJ:
                data = iter_attrs(buf, start + NFGEN.size, end).get(_OBJ_DATA, b"")
                packets = iter_attrs(data, 0, len(data)).get(_COUNTER_PACKETS)
                if packets is not None and len(packets) >= 8:
                    return int(struct.unpack_from("!Q", packets)[0])
        raise DatapathError(f"counter {name}: the kernel's answer had no packet count")

    def _ask(
        self, kind: int, flags: int, body: bytes, what: str, absent_ok: bool = False
    ) -> Answer:
        """Send one request; every message of its answer, up to its end (a dump's DONE,
        a request's ack), as (type, buffer, payload start, payload end). With
        ``absent_ok``, ENOENT (its table or set not there, or deleted part way) is no
        answer, not an error. ``interrupted`` says whether the ruleset changed during a
        dump (NLM_F_DUMP_INTR): what it holds may then be short of an element."""
        self._seq += 1
        seq = self._seq
        msg = message(kind, NLM_F_REQUEST | flags, seq, _NFPROTO_INET, 0, body)
        self.interrupted = False
        try:
            out, err, self.interrupted = exchange(self._sock, msg, seq)
        except TimeoutError:
            raise DatapathError(f"{what}: no answer from the kernel in {TIMEOUT_S:g} s") from None
        except OSError as exc:
            raise DatapathError(f"{what}: {exc.strerror or exc}") from None
        # A dump that failed part way (its table or set deleted) ends with DONE carrying
        # the error, not with an ERROR.
        if err == errno.ENOENT and absent_ok:
            return []
        if err > 0:
            raise DatapathError(f"{what}: {os.strerror(err)}")
        return out  # a dump's end, or a request's ack


def _each(buf: bytes, kind: int) -> list[bytes]:
    """The payload of each attribute of ``kind`` in ``buf`` (a nested attribute's)."""
    out = []
    pos = 0
    while pos + 4 <= len(buf):
        length, got = struct.unpack_from("=HH", buf, pos)
        if length < 4 or pos + length > len(buf):
            break
        if (got & 0x3FFF) == kind:
            out.append(buf[pos + 4 : pos + length])
        pos += (length + 3) & ~3
    return out


def _count(buf: bytes, kind: int) -> int:
    """How many attributes of ``kind`` lie in ``buf`` (a nested attribute's payload)."""
    return len(_each(buf, kind))
