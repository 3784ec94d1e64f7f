"""A sandbox's links, addresses, routes and neighbours as rtnetlink batches packed here.

Each pyroute2 call costs 0.2-0.3 ms of Python around a kernel call of a few µs (its sync
API runs an event loop per call, and it parses every reply), and a sandbox's wiring took
a dozen of them: 10 ms of a create at 300 sandboxes. Here each step's messages are packed
with ``struct`` (the uapi layouts of linux/netlink.h, rtnetlink.h, if_link.h, if_addr.h,
veth.h, neighbour.h, which the kernel keeps stable) and sent at once on a socket opened in
the netns; the kernel runs them in order and acks each. pyroute2 stays for everything
else.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from egress.errors import SandboxError
from egress.kernel.netns import in_netns
from egress.kernel.nfnetlink import attr  # netlink attributes are the same in every family

_HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg: family, dst_len, src_len, tos, table, ...
_NDMSG = struct.Struct("=BxxxiHBB")  # ndmsg: family, pad, ifindex, state, flags, type
_ATTR = struct.Struct("=HH")  # rtattr: len, type
_ERR = struct.Struct("=i")

NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWLINK, RTM_GETLINK, RTM_NEWADDR, RTM_NEWROUTE, RTM_NEWNEIGH = 16, 18, 20, 24, 28
NLM_F_REQUEST, NLM_F_ACK, NLM_F_REPLACE, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x100, 0x200, 0x400
IFF_UP = 0x1
IFLA_ADDRESS, IFLA_IFNAME, IFLA_LINKINFO, IFLA_NET_NS_FD = 1, 3, 18, 28
NDA_DST, NDA_LLADDR, NUD_PERMANENT = 1, 2, 0x80
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFA_ADDRESS, IFA_LOCAL, IFA_F_NODAD = 1, 2, 0x02
RTA_OIF, RTA_GATEWAY = 4, 5
RT_TABLE_MAIN, RTPROT_STATIC, RTN_UNICAST = 254, 4, 1
LOOPBACK_INDEX = 1  # the kernel gives lo ifindex 1 in every netns
TIMEOUT_S = 5.0


def _name(ifname: str) -> bytes:
    return attr(IFLA_IFNAME, ifname.encode() + b"\0")


@dataclass
class Batch:
    """Requests for one netns, sent together by ``run``; each is acked or refused."""

    steps: list[tuple[int, int, bytes, str]] = field(default_factory=list)

    def _add(self, kind: int, flags: int, body: bytes, what: str) -> None:
        self.steps.append((kind, flags, body, what))

    def veth(
        self, ifname: str, peer: str, peer_netns_fd: int, macs: tuple[bytes, bytes] | None = None
    ) -> None:
        """A veth pair: ``ifname`` here, ``peer`` in the netns of that fd; ``macs``: their
        hardware addresses (else the kernel picks random ones, which udev's
        MACAddressPolicy=persistent may replace a moment later in the host netns)."""
        mac, peer_mac = (attr(IFLA_ADDRESS, m) for m in macs) if macs else (b"", b"")
        peer_msg = _IFINFO.pack(0, 0, 0, 0, 0) + _name(peer) + peer_mac
        peer_msg += attr(IFLA_NET_NS_FD, struct.pack("=I", peer_netns_fd))
        data = attr(IFLA_INFO_DATA, attr(VETH_INFO_PEER, peer_msg))
        info = attr(IFLA_LINKINFO, attr(IFLA_INFO_KIND, b"veth\0") + data)
        body = _IFINFO.pack(0, 0, 0, 0, 0) + _name(ifname) + mac + info
        self._add(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body, f"create veth {ifname}/{peer}")

    def up(self, index: int, what: str) -> None:
        self._add(RTM_NEWLINK, 0, _IFINFO.pack(0, 0, index, IFF_UP, IFF_UP), f"set {what} up")

    def address(self, index: int, ifname: str, with_prefix: str) -> None:
        """An address; IPv6 without duplicate detection, so it is usable at once."""
        iface = ipaddress.ip_interface(with_prefix)
        v6 = iface.version == 6
        packed = iface.ip.packed
        head = _IFADDR.pack(
            socket.AF_INET6 if v6 else socket.AF_INET,
            iface.network.prefixlen,
            IFA_F_NODAD if v6 else 0,
            0,  # RT_SCOPE_UNIVERSE
            index,
        )
        body = head + attr(IFA_LOCAL, packed) + attr(IFA_ADDRESS, packed)
        what = f"add address {with_prefix} to {ifname}"
        self._add(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body, what)

    def default_route(self, gateway: str, oif: int) -> None:
        gw = ipaddress.ip_address(gateway)
        family = socket.AF_INET6 if gw.version == 6 else socket.AF_INET
        head = _RTMSG.pack(family, 0, 0, 0, RT_TABLE_MAIN, RTPROT_STATIC, 0, RTN_UNICAST, 0)
        body = head + attr(RTA_GATEWAY, gw.packed) + attr(RTA_OIF, struct.pack("=I", oif))
        what = f"add default route via {gateway}"
        self._add(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, body, what)

    def neighbour(self, index: int, ifname: str, address: str, mac: bytes) -> None:
        """A permanent neighbour entry: ``address`` is at ``mac`` on link ``index``
        (made, or put in place of a learned one), so no ARP or neighbour discovery
        runs for it. The kernel keeps one neighbour table per family for every netns,
        and past ``gc_thresh3`` entries (1,024 by default) it learns no new one; a
        permanent entry is not counted against that bound (Linux 5.0 and later)."""
        ip = ipaddress.ip_address(address)
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        body = _NDMSG.pack(family, index, NUD_PERMANENT, 0, 0)
        body += attr(NDA_DST, ip.packed) + attr(NDA_LLADDR, mac)
        what = f"pin neighbour {address} on {ifname}"
        self._add(RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_REPLACE, body, what)


class Rtnl:
    """A NETLINK_ROUTE socket bound to the netns it was opened in."""

    def __init__(self, netns: str | None) -> None:
        self.where = netns or "host netns"
        try:
            with in_netns(netns):
                sock = socket.socket(
                    socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE
                )
        except OSError as exc:
            raise SandboxError(f"open rtnetlink in {self.where}: {exc.strerror}") from None
        try:
            sock.bind((0, 0))
            sock.settimeout(TIMEOUT_S)
        except OSError as exc:
            sock.close()
            raise SandboxError(f"open rtnetlink in {self.where}: {exc.strerror}") from None
        self._sock = sock
        self._seq = 0

    def close(self) -> None:
        self._sock.close()

    def run(self, batch: Batch) -> None:
        """Send every request of ``batch`` at once; raise for the first the kernel refused
        (the kernel goes on with the rest: a failed create is undone by its caller)."""
        first = self._seq + 1
        out = bytearray()
        for kind, flags, body, _ in batch.steps:
            self._seq += 1
            out += _HDR.pack(_HDR.size + len(body), kind, NLM_F_REQUEST | NLM_F_ACK | flags,
                             self._seq, 0) + body  # fmt: skip
        self._send(bytes(out), "send")
        errors = {}
        for seq, code, _ in self._replies(first, len(batch.steps)):
            if code:
                errors[seq] = code
        if errors:
            seq = min(errors)
            what = batch.steps[seq - first][3]
            code = -errors[seq]
            raise SandboxError(f"{what} in {self.where}: {os.strerror(code)} (errno {code})")

    def index(self, ifname: str) -> int:
        """The ifindex of a link by name."""
        return self.link(ifname)[0]

    def link(self, ifname: str) -> tuple[int, bytes]:
        """The ifindex and hardware address of a link by name (b"" if it has none)."""
        self._seq += 1
        body = _IFINFO.pack(0, 0, 0, 0, 0) + _name(ifname)
        self._send(_HDR.pack(_HDR.size + len(body), RTM_GETLINK, NLM_F_REQUEST, self._seq, 0)
                   + body, f"look up {ifname}")  # fmt: skip
        for _, code, payload in self._replies(self._seq, 1):
            if code == -errno.ENODEV:
                raise SandboxError(f"no link {ifname} in {self.where}")
            if code:
                raise SandboxError(f"look up {ifname} in {self.where}: {os.strerror(-code)}")
            return int(_IFINFO.unpack_from(payload)[2]), _attribute(payload, IFLA_ADDRESS)
        raise AssertionError("unreachable")

    def _send(self, data: bytes, what: str) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise SandboxError(f"rtnetlink {what} in {self.where}: {exc}") from None

    def _replies(self, first: int, count: int) -> Iterator[tuple[int, int, bytes]]:
        """(seq, error code or 0, payload) of one reply per request ``first``..."""
        seen = 0
        while seen < count:
            try:
                buf = self._sock.recv(65536)
            except OSError as exc:  # a timeout too: the kernel answers at once or never
                raise SandboxError(f"rtnetlink answer in {self.where}: {exc}") from None
            at = 0
            while at + _HDR.size <= len(buf):
                length, kind, _, seq, _ = _HDR.unpack_from(buf, at)
                if length < _HDR.size:
                    raise SandboxError(f"rtnetlink answer in {self.where}: malformed")
                payload = buf[at + _HDR.size : at + length]
                at += (length + 3) & ~3
                if not first <= seq < first + count or kind == NLMSG_DONE:
                    continue  # not an answer to these requests
                seen += 1
                code = _ERR.unpack_from(payload)[0] if kind == NLMSG_ERROR else 0
                yield seq, code, payload


def _attribute(payload: bytes, kind: int) -> bytes:
    """The value of the first top-level attribute ``kind`` of an ifinfomsg (b"": none)."""
    at = _IFINFO.size
    while at + _ATTR.size <= len(payload):
        length, got = _ATTR.unpack_from(payload, at)
        if length < _ATTR.size:
            break
        if got & 0x3FFF == kind:  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
            return bytes(payload[at + _ATTR.size : at + length])
        at += (length + 3) & ~3
    return b""


@contextmanager
def opened(netns: str | None) -> Iterator[Rtnl]:
    rtnl = Rtnl(netns)
    try:
        yield rtnl
    finally:
        rtnl.close()
