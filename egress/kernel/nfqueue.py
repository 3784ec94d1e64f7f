"""Hold the packets nftables queues to an NFQUEUE number, and give each one its verdict.

The inline layer judges a TCP flow by the name its first client bytes ask for (TLS SNI,
HTTP Host: ``egress.inline.flowcheck``). The sandbox's rules mark those segments and an
iptables-nft NFQUEUE rule (``queue_rule``) hands them to this listener; the kernel holds
each one until ``verdict()`` says accept (optionally re-marked, or re-run through the
rule with ``repeat``, which then asks conntrack again whether to queue it) or drop.
pyroute2 0.9.7 has no NFQUEUE support, so this speaks nfnetlink_queue directly over a raw
NETLINK_NETFILTER socket, in the manner of ``egress.kernel.nflog``. The rule's side does
not matter here: nft's ``queue`` needs nft_queue (CONFIG_NFT_QUEUE, absent from this
project's test kernels), iptables-nft's ``-j NFQUEUE`` goes through nft_compat instead.

NFQUEUE is per netns, so the socket is opened under ``in_netns``. A queue number has at
most one listener per netns (another socket binding it gets EPERM). The point is failing
closed: the rules use ``queue`` without ``bypass`` and the listener never sets
FAIL_OPEN, so while nobody listens, or when the queue is full (``maxlen``) or the socket
cannot take another packet, the kernel drops what it would have queued; a packet still
held when the listener closes is dropped too. Each packet carries the uid/gid of the
socket that sent it (NFQA_CFG_F_UID_GID), and GSO packets arrive whole (NFQA_CFG_F_GSO)
instead of being segmented for us.

The socket is non-blocking: hand ``fileno()`` to ``loop.add_reader``, call
``read_packets()`` when it is readable and ``verdict()`` for every packet it returned.
Verdicts are sent without NLM_F_ACK (the hot path waits for nothing); the kernel still
reports a failed verdict (an unknown packet id, say) as an error message on the socket,
which ``read_packets`` counts in ``verdict_errors``. Not thread-safe.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass

from egress.datapath.packet import Packet, parse_ip_packet
from egress.errors import DatapathError
from egress.kernel.nfnetlink import (
    NFGEN,
    NLM_F_REQUEST,
    NLMSG_ERROR,
    NfnlListener,
    attr,
    be32,
    iter_attrs,
    open_socket,
)

_NFNL_SUBSYS_QUEUE = 3
_NFQNL_MSG_PACKET, _NFQNL_MSG_VERDICT, _NFQNL_MSG_CONFIG = 0, 1, 2
# packet and verdict attributes (linux/netfilter/nfnetlink_queue.h)
_A_PACKET_HDR, _A_VERDICT_HDR, _A_MARK, _A_PAYLOAD, _A_UID, _A_GID = 1, 2, 3, 10, 16, 17
# config attributes, commands and flags
_CFG_CMD, _CFG_PARAMS, _CFG_QUEUE_MAXLEN, _CFG_MASK, _CFG_FLAGS = 1, 2, 3, 4, 5
_CMD_BIND, _CMD_UNBIND = 1, 2
_COPY_PACKET = 2
F_FAIL_OPEN, F_CONNTRACK, F_GSO, F_UID_GID = 1, 2, 4, 8
_FLAGS = F_UID_GID | F_GSO  # never F_FAIL_OPEN: the mask clears it explicitly
_MASK = F_UID_GID | F_GSO | F_FAIL_OPEN
# verdicts (linux/netfilter.h)
NF_DROP, NF_ACCEPT, NF_REPEAT = 0, 1, 4
_PACKET_HDR = struct.Struct("!IHB")  # packet_id, hw_protocol, hook (packed, 7 bytes)
_VERDICT_TYPE = (_NFNL_SUBSYS_QUEUE << 8) | _NFQNL_MSG_VERDICT
_PACKET_TYPE = (_NFNL_SUBSYS_QUEUE << 8) | _NFQNL_MSG_PACKET


@dataclass(frozen=True)
class QueuedPacket:
    """One packet the kernel holds until ``verdict(packet_id, ...)``. uid/gid belong to
    the socket that sent it, when it has one (a locally sent TCP segment has)."""

    packet_id: int
    hw_protocol: int  # ethertype: 0x0800, 0x86DD
    hook: int  # netfilter hook: 3 is NF_INET_LOCAL_OUT
    payload: bytes  # the IP packet, cut at the copy range
    mark: int | None  # skb mark, None when 0 (the kernel leaves the attribute out)
    uid: int | None
    gid: int | None
    family: int  # 4 or 6 from the IP version nibble (0 if unknown)
    packet: Packet | None  # the addressing, None if the payload does not parse
    timestamp: float  # time.time() at receipt

    @property
    def tcp_payload(self) -> bytes:
        """The TCP segment's data as captured: what ``firstbytes.judge`` reads. Empty if
        this is not a TCP packet, or a fragment."""
        if self.packet is None or self.packet.proto != "tcp" or self.packet.fragment:
            return b""
        return self.packet.payload


class NfqueueListener(NfnlListener[QueuedPacket]):
    """A bound NFQUEUE number in one netns. ``overruns`` counts receive-queue overflows
    (ENOBUFS): packets the kernel could not hand over, and dropped (fail closed)."""

    SUBSYS = _NFNL_SUBSYS_QUEUE
    CONFIG_MSG = _NFQNL_MSG_CONFIG
    KIND = "NFQUEUE"

    def __init__(self, sock: socket.socket, queue: int, netns: str | None) -> None:
        super().__init__(sock, queue, netns)
        self.queue = queue
        self.verdict_errors = 0  # errors the kernel sent back for unacked verdicts
        self.last_verdict_error: str | None = None

    @classmethod
    def open(
        cls,
        netns: str | None,
        queue: int,
        copy_range: int = 65535,
        maxlen: int = 1024,
        rcvbuf: int = 4 << 20,
    ) -> NfqueueListener:
        """Bind queue (0..65535) in netns, copying up to copy_range bytes per packet and
        holding at most maxlen packets (the kernel drops beyond that)."""
        if not 0 <= queue <= 0xFFFF:
            raise DatapathError(f"NFQUEUE number out of range: {queue}")
        if not 0 < copy_range <= 0xFFFF:
            raise DatapathError(f"NFQUEUE copy range out of range: {copy_range}")
        if not 0 < maxlen <= 0xFFFFFFFF:
            raise DatapathError(f"NFQUEUE maxlen out of range: {maxlen}")
        listener = cls(open_socket(netns), queue, netns)
        try:
            listener._setup(copy_range, maxlen, rcvbuf)
        except BaseException:
            listener.release()  # closing releases a binding the first message may have made
            raise
        return listener

    def _setup(self, copy_range: int, maxlen: int, rcvbuf: int) -> None:
        self._bind_socket(rcvbuf)
        # No PF_BIND: obsolete since Linux 3.8, `queue num N` reaches us without it.
        self._config("bind", attr(_CFG_CMD, struct.pack("!BBH", _CMD_BIND, 0, 0)))
        self._config(
            "configure",
            attr(_CFG_PARAMS, struct.pack("!IB", copy_range, _COPY_PACKET))
            + attr(_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen))
            + attr(_CFG_MASK, struct.pack("!I", _MASK))
            + attr(_CFG_FLAGS, struct.pack("!I", _FLAGS)),
        )

    def read_packets(self, max_packets: int = 256) -> list[QueuedPacket]:
        """Drain what is ready now (up to max_packets) without blocking. Every packet
        returned waits in the kernel (counting against maxlen) until its verdict."""
        return self._drain(max_packets)

    def _decode(self, kind: int, buf: bytes, pos: int, end: int) -> list[QueuedPacket]:
        if kind == NLMSG_ERROR and end - pos >= 4:
            err = -struct.unpack_from("=i", buf, pos)[0]
            if err:  # a verdict the kernel refused (sent without ack, so only errors come)
                self.verdict_errors += 1
                self.last_verdict_error = os.strerror(err)
            return []
        if kind != _PACKET_TYPE or end - pos < NFGEN.size:
            return []
        attrs = iter_attrs(buf, pos + NFGEN.size, end)
        hdr = attrs.get(_A_PACKET_HDR, b"")
        if len(hdr) < _PACKET_HDR.size:
            return []  # no id: nothing could be said about it, and the kernel drops it in time
        packet_id, hw_protocol, hook = _PACKET_HDR.unpack_from(hdr)
        payload = attrs.get(_A_PAYLOAD, b"")
        version = payload[0] >> 4 if payload else 0
        return [
            QueuedPacket(
                packet_id=packet_id,
                hw_protocol=hw_protocol,
                hook=hook,
                payload=payload,
                mark=be32(attrs, _A_MARK),
                uid=be32(attrs, _A_UID),
                gid=be32(attrs, _A_GID),
                family=version if version in (4, 6) else 0,
                packet=parse_ip_packet(payload),
                timestamp=time.time(),
            )
        ]

    def _unbind_attrs(self) -> bytes:
        return attr(_CFG_CMD, struct.pack("!BBH", _CMD_UNBIND, 0, 0))

    def verdict(
        self, packet_id: int, accept: bool, mark: int | None = None, repeat: bool = False
    ) -> None:
        """Release (accept) or drop a held packet; with repeat, re-run it through the
        chain that queued it (NF_REPEAT), typically with a new mark a rule accepts.
        No ack is asked for; a refused verdict shows up in ``verdict_errors``."""
        if repeat and not accept:
            raise DatapathError("NFQUEUE verdict: repeat applies to an accepted packet")
        if mark is not None and not 0 <= mark <= 0xFFFFFFFF:
            raise DatapathError(f"NFQUEUE mark out of range: {mark}")
        code = NF_REPEAT if repeat else NF_ACCEPT if accept else NF_DROP
        attrs = attr(_A_VERDICT_HDR, struct.pack("!II", code, packet_id))
        if mark is not None:
            attrs += attr(_A_MARK, struct.pack("!I", mark))
        try:
            self._require().send(self._message(_VERDICT_TYPE, NLM_F_REQUEST, attrs))
        except OSError as exc:
            raise DatapathError(f"{self._where()}: verdict on {packet_id}: {exc}") from exc

    def __enter__(self) -> NfqueueListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
