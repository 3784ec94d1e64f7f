"""Conntrack entries of one netns whose flow began from an address not its own.

A sandbox's rules check a packet's source only before conntrack's accept: a flow that
never had an entry cannot pass as established. A sandbox an older egress made may still
hold one (its workload bound another IPv6 address and sent from it), and its replies,
from the sandbox's own address, would pass as established. ``forget_foreign`` deletes
such entries once the rules with the check are in: the flow's next packet is new, and
meets them.

ctnetlink by hand, over ``nfnetlink``'s socket helpers: pyroute2 0.9.7's Conntrack dumps
IPv4 entries only, and opens its socket lazily, outside the netns it was made in.
"""

from __future__ import annotations

import errno
import ipaddress
import socket

from egress.errors import DatapathError
from egress.kernel.netns import in_netns
from egress.kernel.nfnetlink import (
    NLM_F_ACK,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    attr,
    exchange,
    iter_attrs,
    message,
    open_socket,
)

NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_GET = 1
IPCTNL_MSG_CT_DELETE = 2
NLA_F_NESTED = 0x8000
CTA_TUPLE_ORIG = 1
CTA_ID = 12
CTA_TUPLE_IP = 1
CTA_IP_V4_SRC = 1
CTA_IP_V6_SRC = 3
_FAMILY: dict[int, int] = {int(socket.AF_INET): CTA_IP_V4_SRC, int(socket.AF_INET6): CTA_IP_V6_SRC}


def forget_foreign(netns: str) -> list[str]:
    """Delete the entries of ``netns`` whose original source is no address of it (a
    socket there could not bind it without IP(V6)_FREEBIND); returns the sources of
    those it deleted (one that ended meanwhile is not)."""
    sock = open_socket(netns)
    try:
        sock.bind((0, 0))
        sock.settimeout(5.0)
        entries = _dump(sock)
        local = _local(netns, {source for _, source, _, _ in entries})
        gone = []
        kind = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE
        for seq, (family, source, tuple_orig, ct_id) in enumerate(entries, start=2):
            if source in local:
                continue
            body = attr(CTA_TUPLE_ORIG | NLA_F_NESTED, tuple_orig) + attr(CTA_ID, ct_id)
            msg = message(kind, NLM_F_REQUEST | NLM_F_ACK, seq, family, 0, body)
            _, err, _ = exchange(sock, msg, seq)
            if err == 0:
                gone.append(source)
            elif err != errno.ENOENT:  # ENOENT: it ended meanwhile
                raise DatapathError(
                    f"netns {netns}: cannot delete the conntrack entry from {source}: "
                    f"{errno.errorcode.get(err, err)}"
                )
        return gone
    except OSError as exc:
        raise DatapathError(f"netns {netns}: conntrack: {exc}") from exc
    finally:
        sock.close()


Entry = tuple[int, str, bytes, bytes]  # family, original source, raw CTA_TUPLE_ORIG, CTA_ID


def _dump(sock: socket.socket) -> list[Entry]:
    kind = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET
    msg = message(kind, NLM_F_REQUEST | NLM_F_DUMP, 1, socket.AF_UNSPEC, 0, b"")
    answer, err, _ = exchange(sock, msg, 1)
    if err:
        raise DatapathError(f"conntrack dump: {errno.errorcode.get(err, err)}")
    out: list[Entry] = []
    for _, buf, start, end in answer:
        family = buf[start]
        attrs = iter_attrs(buf, start + 4, end)
        tuple_orig, ct_id = attrs.get(CTA_TUPLE_ORIG), attrs.get(CTA_ID)
        if tuple_orig is None or ct_id is None or family not in _FAMILY:
            continue
        ip = iter_attrs(tuple_orig, 0, len(tuple_orig)).get(CTA_TUPLE_IP, b"")
        raw = iter_attrs(ip, 0, len(ip)).get(_FAMILY[family])
        if raw is not None:
            out.append((family, str(ipaddress.ip_address(raw)), tuple_orig, ct_id))
    return out


def _local(netns: str, addresses: set[str]) -> set[str]:
    """Those of ``addresses`` a socket in ``netns`` could bind: the kernel's own answer.
    One it cannot judge (a link-local address wants its interface) counts as local: such
    a flow never leaves the link."""
    found = set()
    with in_netns(netns):
        for address in addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                try:
                    probe.bind((address, 0))
                except OSError as exc:
                    if exc.errno == errno.EADDRNOTAVAIL:
                        continue
                found.add(address)
    return found
