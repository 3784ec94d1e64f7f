"""NFLOG messages built by hand, as nfnetlink_log sends them: what the listener's tests,
the walk's tests and bench/bench_nflog.py feed to the code that reads the kernel's copies."""

from __future__ import annotations

import socket
import struct

from egress.datapath import constants as c
from egress.kernel.nfnetlink import HDR, NFGEN, attr

PACKET = (4 << 8) | 0  # NFNL_SUBSYS_ULOG, NFULNL_MSG_PACKET
GROUP = c.OBSERVER_GROUP
# An IPv4 UDP datagram to port 53 with 32 bytes of payload: a copied query's shape.
QUERY = bytes.fromhex("4500003c1c4640004011" + "00" * 10) + b"\x30\x39\x00\x35\x00\x28\x00\x00"
QUERY += bytes(32)


def copy(
    prefix: bytes | None,
    payload: bytes | None = QUERY[:28],
    kind: int = PACKET,
    extra: bytes = b"",
) -> bytes:
    """A message laid out as nfnetlink_log sends one: header, hw protocol and hook,
    prefix (``prefix`` and its NUL), out device, uid, gid, payload last; ``extra``
    attributes before the gid. None leaves an attribute out."""
    body = NFGEN.pack(socket.AF_INET, 0, GROUP) + attr(1, struct.pack("!HBx", 0x0800, 3))
    if prefix is not None:
        body += attr(10, prefix + b"\0")
    body += attr(5, struct.pack("!I", 1)) + attr(11, struct.pack("!I", 65534)) + extra
    body += attr(14, struct.pack("!I", 65534))
    if payload is not None:
        body += attr(9, payload)
    return HDR.pack(HDR.size + len(body), kind, 0, 7, 0) + body
