"""Receive the packets nftables logs to an NFLOG group, from inside a sandbox's netns.

The observer layer sees every dropped connect and every DNS query through the kernel's
``log group N`` copies, independently of the resolver. pyroute2 0.9.7 has no NFLOG
support, so this speaks nfnetlink_log directly over a raw NETLINK_NETFILTER socket.

NFLOG is per netns, so the socket is opened under ``in_netns``; each group has at most
one listener per netns (a second bind fails), so independent watchers use separate
groups. The socket is non-blocking: hand ``fileno()`` to ``loop.add_reader`` and call
``read_events()`` when it is readable. Not thread-safe.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
from dataclasses import dataclass

from egress.datapath.packet import Packet, parse_ip_packet
from egress.errors import DatapathError
from egress.kernel.netns import in_netns
from egress.model import Flow

NETLINK_NETFILTER = 12
_SOL_NETLINK = 270
_NFNL_SUBSYS_ULOG = 4
_NFULNL_MSG_PACKET = 0
_NFULNL_MSG_CONFIG = 1
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_NLM_F_REQUEST = 0x1
_NLM_F_ACK = 0x4
# config attributes and commands (linux/netfilter/nfnetlink_log.h)
_CFG_CMD, _CFG_MODE, _CFG_TIMEOUT, _CFG_QTHRESH = 1, 2, 4, 5
_CMD_BIND, _CMD_UNBIND = 1, 2
_COPY_PACKET = 2
# packet attributes
_A_PACKET_HDR, _A_IFINDEX_INDEV, _A_IFINDEX_OUTDEV = 1, 4, 5
_A_PAYLOAD, _A_PREFIX, _A_UID, _A_GID = 9, 10, 11, 14
_HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_NFGEN = struct.Struct("!BBH")  # nfgenmsg: family, version, res_id (big endian)
_FAMILIES = {int(socket.AF_INET): 4, int(socket.AF_INET6): 6}
_RECV_SIZE = 1 << 17
_SO_RCVBUFFORCE = 33  # not exported by the socket module


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


def _attr(kind: int, data: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(data), kind) + data
    return raw + b"\0" * (-len(raw) % 4)


def _iter_attrs(buf: bytes, pos: int, end: int) -> dict[int, bytes]:
    attrs: dict[int, bytes] = {}
    while pos + 4 <= end:
        length, kind = struct.unpack_from("=HH", buf, pos)
        if length < 4 or pos + length > end:
            break
        attrs[kind & 0x3FFF] = buf[pos + 4 : pos + length]
        pos += (length + 3) & ~3
    return attrs


def _be32(attrs: dict[int, bytes], kind: int) -> int | None:
    raw = attrs.get(kind)
    return struct.unpack("!I", raw[:4])[0] if raw is not None and len(raw) >= 4 else None


class NflogListener:
    """A bound NFLOG group in one netns. ``overruns`` counts receive-queue overflows
    (ENOBUFS): the kernel dropped log copies; the rule's counter still has them all."""

    def __init__(self, sock: socket.socket, group: int, netns: str | None) -> None:
        self._sock: socket.socket | None = sock
        self.group = group
        self.netns = netns
        self.overruns = 0
        # Another process holds this same socket (egressd handing over, or handed over
        # to): closing must not unbind the group under it. The kernel drops the binding
        # when the last descriptor of the socket closes anyway.
        self.shared = False
        self._seq = 0
        self._pending: list[NflogEvent] = []

    @classmethod
    def open(
        cls,
        netns: str | None,
        group: int,
        copy_range: int = 512,
        rcvbuf: int = 4 << 20,
    ) -> NflogListener:
        """Bind group (0..65535) in netns, copying up to copy_range bytes per packet."""
        if not 0 <= group <= 0xFFFF:
            raise DatapathError(f"NFLOG group out of range: {group}")
        if not 0 < copy_range <= 0xFFFF:
            raise DatapathError(f"NFLOG copy range out of range: {copy_range}")
        try:
            with in_netns(netns):
                sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        except OSError as exc:
            raise DatapathError(f"cannot open an nfnetlink socket: {exc}") from exc
        listener = cls(sock, group, netns)
        try:
            listener._setup(copy_range, rcvbuf)
        except BaseException:
            sock.close()
            raise
        return listener

    def _setup(self, copy_range: int, rcvbuf: int) -> None:
        sock = self._require()
        sock.bind((0, 0))
        try:
            # FORCE lets root exceed net.core.rmem_max; bursts of drops must not overflow.
            sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, rcvbuf)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        # No PF_BIND: `log group N` reaches nfnetlink_log without it, and PF_BIND would
        # make nfnetlink_log the netns-wide default logger for plain `log` statements.
        self._config(
            _attr(_CFG_CMD, bytes([_CMD_BIND]))
            + _attr(_CFG_MODE, struct.pack("!IBB", copy_range, _COPY_PACKET, 0))
            # Queue threshold 1: the kernel otherwise batches up to 100 packets or 1 s.
            + _attr(_CFG_QTHRESH, struct.pack("!I", 1))
            + _attr(_CFG_TIMEOUT, struct.pack("!I", 0))
        )
        sock.setblocking(False)

    def _require(self) -> socket.socket:
        if self._sock is None:
            raise DatapathError("NFLOG listener is closed")
        return self._sock

    def _config(self, attrs: bytes) -> None:
        """Send a config message to our group and wait for the kernel's ack."""
        sock = self._require()
        self._seq += 1
        body = _NFGEN.pack(socket.AF_UNSPEC, 0, self.group) + attrs
        msg_type = (_NFNL_SUBSYS_ULOG << 8) | _NFULNL_MSG_CONFIG
        flags = _NLM_F_REQUEST | _NLM_F_ACK
        sock.send(_HDR.pack(_HDR.size + len(body), msg_type, flags, self._seq, 0) + body)
        sock.settimeout(2.0)
        try:
            self._await_ack(sock)
        except OSError as exc:
            raise DatapathError(f"NFLOG group {self.group}: {exc}") from exc
        finally:
            sock.setblocking(False)

    def _await_ack(self, sock: socket.socket) -> None:
        while True:
            try:
                buf = sock.recv(_RECV_SIZE)
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise  # includes the timeout
                self.overruns += 1  # log copies lost while we waited; the ack still comes
                continue
            for kind, seq, pos, end in _messages(buf):
                if kind == _NLMSG_ERROR and seq == self._seq:
                    err = -struct.unpack_from("=i", buf, pos)[0]
                    if err:
                        raise DatapathError(
                            f"NFLOG config group {self.group} in {self.netns or 'current netns'}:"
                            f" {os.strerror(err)}"
                        )
                    return
                self._pending.extend(self._decode(kind, buf, pos, end))

    def fileno(self) -> int:
        return self._require().fileno()

    def read_events(self, max_events: int = 4096) -> list[NflogEvent]:
        """Drain what is ready now (up to max_events) without blocking."""
        sock = self._require()
        events, self._pending = self._pending, []
        while len(events) < max_events:
            try:
                buf = sock.recv(_RECV_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise DatapathError(f"NFLOG receive: {exc}") from exc
                self.overruns += 1
                continue
            for kind, _seq, pos, end in _messages(buf):
                events.extend(self._decode(kind, buf, pos, end))
        return events

    def _decode(self, kind: int, buf: bytes, pos: int, end: int) -> list[NflogEvent]:
        if kind != (_NFNL_SUBSYS_ULOG << 8) | _NFULNL_MSG_PACKET or end - pos < _NFGEN.size:
            return []
        family, _version, group = _NFGEN.unpack_from(buf, pos)
        return [_event(group, family, _iter_attrs(buf, pos + _NFGEN.size, end))]

    @property
    def sock(self) -> socket.socket:
        """The bound socket itself (egressd hands it to its successor)."""
        return self._require()

    def release(self) -> None:
        """Close our descriptor but keep the binding: another process holds the same
        socket (a successor egressd) and goes on reading the group."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Unbind the group (so another listener may take it) and close the socket."""
        if self._sock is None:
            return
        if self.shared:
            self.release()
            return
        try:
            self._config(_attr(_CFG_CMD, bytes([_CMD_UNBIND])))
        except DatapathError:
            pass  # closing the socket releases the binding as well
        finally:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> NflogListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _messages(buf: bytes) -> list[tuple[int, int, int, int]]:
    """(type, seq, payload start, payload end) of each netlink message in buf."""
    out = []
    pos = 0
    while pos + _HDR.size <= len(buf):
        length, kind, _flags, seq, _pid = _HDR.unpack_from(buf, pos)
        if length < _HDR.size or pos + length > len(buf):
            break
        if kind != _NLMSG_DONE:
            out.append((kind, seq, pos + _HDR.size, pos + length))
        pos += (length + 3) & ~3
    return out


def _event(group: int, nfgen_family: int, attrs: dict[int, bytes]) -> NflogEvent:
    payload = attrs.get(_A_PAYLOAD, b"")
    hdr = attrs.get(_A_PACKET_HDR, b"")
    prefix = attrs.get(_A_PREFIX, b"").split(b"\0", 1)[0]
    packet = parse_ip_packet(payload)
    return NflogEvent(
        group=group,
        prefix=prefix.decode("utf-8", "replace"),
        payload=payload,
        uid=_be32(attrs, _A_UID),
        gid=_be32(attrs, _A_GID),
        family=_FAMILIES.get(nfgen_family, payload[0] >> 4 if payload else 0),
        hw_protocol=struct.unpack("!H", hdr[:2])[0] if len(hdr) >= 2 else 0,
        timestamp=time.time(),
        flow=packet.flow() if packet is not None else None,
        packet=packet,
        indev=_be32(attrs, _A_IFINDEX_INDEV),
        outdev=_be32(attrs, _A_IFINDEX_OUTDEV),
    )
