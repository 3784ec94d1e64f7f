"""Receive the packets nftables logs to an NFLOG group, from inside a sandbox's netns.

The observer layer sees every dropped connect and every DNS query through the kernel's
``log group N`` copies, independently of the resolver. pyroute2 0.9.7 has no NFLOG
support, so this speaks nfnetlink_log directly over a raw NETLINK_NETFILTER socket
(``nfnetlink``: the socket's life, shared with the NFQUEUE listener).

NFLOG is per netns, so the socket is opened under ``in_netns``; each group has at most
one listener per netns (a second bind fails), so independent watchers use separate
groups. The socket is non-blocking: hand ``fileno()`` to ``loop.add_reader`` and call
``read_events()`` when it is readable. Not thread-safe.
"""

from __future__ import annotations

import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from egress.datapath.nflog_wire import Copies, Copy, walk
from egress.datapath.packet import Packet, parse_ip_packet
from egress.errors import DatapathError
from egress.kernel.nfnetlink import (
    NFGEN,
    NfnlListener,
    attr,
    be32,
    iter_attrs,
    messages,
    open_socket,
)
from egress.model import Flow

_NFNL_SUBSYS_ULOG = 4
_NFULNL_MSG_PACKET = 0
_NFULNL_MSG_CONFIG = 1
# config attributes and commands (linux/netfilter/nfnetlink_log.h)
_CFG_CMD, _CFG_MODE, _CFG_NLBUFSIZ, _CFG_TIMEOUT, _CFG_QTHRESH = 1, 2, 3, 4, 5
_CMD_BIND, _CMD_UNBIND = 1, 2
_COPY_PACKET = 2
# packet attributes
_A_PACKET_HDR, _A_IFINDEX_INDEV, _A_IFINDEX_OUTDEV = 1, 4, 5
_A_PAYLOAD, _A_PREFIX, _A_UID, _A_GID = 9, 10, 11, 14
_PACKET_TYPE = (_NFNL_SUBSYS_ULOG << 8) | _NFULNL_MSG_PACKET
_FAMILIES = {int(socket.AF_INET): 4, int(socket.AF_INET6): 6}


@dataclass(frozen=True)
class NflogEvent:
    """One logged packet. uid/gid belong to the socket that sent it, when it has one."""

    group: int
    prefix: str
    payload: bytes  # the IP packet, cut at the copy range
    uid: int | None
    gid: int | None
    family: int  # 4 or 6 (0 if unknown)
    hw_protocol: int
    timestamp: float  # time.time() at receipt
    flow: Flow | None  # the 5-tuple, None if the payload does not parse
    packet: Packet | None = None  # everything parsed, including a UDP payload (DNS)
    indev: int | None = None
    outdev: int | None = None


class NflogListener(NfnlListener[NflogEvent]):
    """A bound NFLOG group in one netns. ``overruns`` counts receive-queue overflows
    (ENOBUFS): the kernel dropped log copies; the rule's counter still has them all."""

    SUBSYS = _NFNL_SUBSYS_ULOG
    CONFIG_MSG = _NFULNL_MSG_CONFIG
    KIND = "NFLOG group"

    def __init__(self, sock: socket.socket, group: int, netns: str | None) -> None:
        super().__init__(sock, group, netns)
        self.group = group
        # Given the copies of one datagram the kernel sent, in order, as ``Copies``: how
        # many of the first ones the reader has dealt with itself (the observer's
        # replays); no events are made of those. Asked only while no event of this read
        # is ahead of them, and it must stop at the first copy it does not deal with: a
        # reader that acts on a copy at once must not act on it before the events that
        # came first. One call a datagram (up to the observer's BATCH copies), not one a
        # copy (but one a copy for those read while an ack is awaited: rare).
        self.sift: Callable[[Copies], int] | None = None

    @classmethod
    def open(
        cls,
        netns: str | None,
        group: int,
        copy_range: int = 512,
        rcvbuf: int = 4 << 20,
        batch: int = 1,
    ) -> NflogListener:
        """Bind group (0..65535) in netns, copying up to copy_range bytes per packet."""
        if not 0 <= group <= 0xFFFF:
            raise DatapathError(f"NFLOG group out of range: {group}")
        if not 0 < copy_range <= 0xFFFF:
            raise DatapathError(f"NFLOG copy range out of range: {copy_range}")
        listener = cls(open_socket(netns), group, netns)
        try:
            listener._setup(copy_range, rcvbuf, batch)
        except BaseException:
            listener.release()
            raise
        return listener

    def _setup(self, copy_range: int, rcvbuf: int, batch: int) -> None:
        self._bind_socket(rcvbuf)
        # No PF_BIND: `log group N` reaches nfnetlink_log without it, and PF_BIND would
        # make nfnetlink_log the netns-wide default logger for plain `log` statements.
        self._config(
            "bind",
            attr(_CFG_CMD, bytes([_CMD_BIND]))
            + attr(_CFG_MODE, struct.pack("!IBB", copy_range, _COPY_PACKET, 0))
            # ``batch`` messages at most (1: each at once), else flushed at the kernel's
            # next tick (timeout 0); the kernel's default is 100 packets or 1 s.
            + attr(_CFG_QTHRESH, struct.pack("!I", batch))
            + attr(_CFG_TIMEOUT, struct.pack("!I", 0))
            + attr(_CFG_NLBUFSIZ, struct.pack("!I", 1 << 16)),
        )

    def read_events(self, max_events: int = 4096) -> list[NflogEvent]:
        """Drain what is ready now (up to max_events) without blocking."""
        return self._drain(max_events)

    def _decode_all(self, buf: bytes, items: list[NflogEvent]) -> int:
        # nflog_wire.walk (compiled) finds each copy's prefix and payload, so a copy the
        # reader deals with itself (a repeat) is never decoded further.
        found = walk(buf, _PACKET_TYPE) if sys.byteorder == "little" else _walk_slowly(buf)
        dealt = 0
        if self.sift is not None and not self._ahead:
            dealt = self.sift(found)
        for kind, pos, end, _prefix, _payload in found[dealt:]:
            self._take(items, kind, buf, pos, end)
        return len(found)

    def _decode(self, kind: int, buf: bytes, pos: int, end: int) -> list[NflogEvent]:
        # One message that came with an ack (NfnlListener._await_ack): rare, so plainly.
        items: list[NflogEvent] = []
        if self.sift is None or self._ahead or not self.sift([_copy(kind, buf, pos, end)]):
            self._take(items, kind, buf, pos, end)
        return items

    def _take(self, items: list[NflogEvent], kind: int, buf: bytes, pos: int, end: int) -> None:
        """Append the event a message is, unless it is no packet copy."""
        if kind != _PACKET_TYPE or end - pos < NFGEN.size:
            return
        family, _version, group = NFGEN.unpack_from(buf, pos)
        items.append(_event(group, family, iter_attrs(buf, pos + NFGEN.size, end)))

    def _unbind_attrs(self) -> bytes:
        return attr(_CFG_CMD, bytes([_CMD_UNBIND]))

    def __enter__(self) -> NflogListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copy(kind: int, buf: bytes, pos: int, end: int) -> Copy:
    """walk's tuple for one message, its attributes read in the host's byte order."""
    if kind != _PACKET_TYPE or end - pos < NFGEN.size:
        return kind, pos, end, b"", b""
    attrs = iter_attrs(buf, pos + NFGEN.size, end)
    return kind, pos, end, attrs.get(_A_PREFIX, b""), attrs.get(_A_PAYLOAD, b"")


def _walk_slowly(buf: bytes) -> Copies:
    """walk's result, read in the host's byte order (walk reads little-endian only)."""
    return [_copy(kind, buf, pos, end) for kind, _seq, pos, end in messages(buf)]


def _event(group: int, nfgen_family: int, attrs: dict[int, bytes]) -> NflogEvent:
    payload = attrs.get(_A_PAYLOAD, b"")
    hdr = attrs.get(_A_PACKET_HDR, b"")
    prefix = attrs.get(_A_PREFIX, b"").split(b"\0", 1)[0]
    packet = parse_ip_packet(payload)
    return NflogEvent(
        group=group,
        prefix=prefix.decode("utf-8", "replace"),
        payload=payload,
        uid=be32(attrs, _A_UID),
        gid=be32(attrs, _A_GID),
        family=_FAMILIES.get(nfgen_family, payload[0] >> 4 if payload else 0),
        hw_protocol=struct.unpack("!H", hdr[:2])[0] if len(hdr) >= 2 else 0,
        timestamp=time.time(),
        flow=packet.flow() if packet is not None else None,
        packet=packet,
        indev=be32(attrs, _A_IFINDEX_INDEV),
        outdev=be32(attrs, _A_IFINDEX_OUTDEV),
    )
