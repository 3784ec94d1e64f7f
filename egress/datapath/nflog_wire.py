"""The messages NFLOG hands over, as bytes: each packet copy's prefix and payload.

The observer reads a copy of every DNS query and answer of its sandbox (two per query)
and most are repeats it deals with from their bytes alone (``observer.sift``, with
``observer.replays`` and ``observer.answers``): walking each message's attributes into a
dict cost more than everything else it does with them. ``walk`` finds, in one pass and
without a dict, the two attributes a repeat needs; the caller decodes a message whole
only when it is not one. ``udp4_payload`` is the next look, at the copied IP packet.

Compiled by mypyc (``egress.datapath.native``): the loops index bytes and add ints,
which compiled take 0.14 us a copy against 1.5 for the sources or the dict
(``bench/bench_nflog.py``). Netlink is in host byte order; ``walk`` reads it as
little-endian (x86-64, arm64), and the listener uses it only on such a host.
"""

from __future__ import annotations

from typing import Final

NLMSG_DONE: Final = 3
NLMSG_HDRLEN: Final = 16  # nlmsghdr: len u32, type u16, flags u16, seq u32, pid u32
NFGEN_LEN: Final = 4  # nfgenmsg, after the header
ATTR_PAYLOAD: Final = 9  # NFULA_PAYLOAD
ATTR_PREFIX: Final = 10  # NFULA_PREFIX (as sent: with its NUL)
ATTR_TYPE_MASK: Final = 0x3FFF  # without NLA_F_NESTED and NLA_F_NET_BYTEORDER

# walk's view of one message: (type, payload start, end, prefix as sent with its NUL, the
# copied IP packet), prefix and packet b"" if it is no copy; and of a datagram.
Copy = tuple[int, int, int, bytes, bytes]
Copies = list[Copy]


def walk(buf: bytes, packet_type: int) -> Copies:
    """(type, payload start, end, prefix, payload) of each netlink message in ``buf``
    but NLMSG_DONE, up to the first that does not fit. ``prefix`` and ``payload`` are
    the NFLOG attributes of a message of ``packet_type`` (b"" if it has none; the last
    of each if repeated) and b"" for any other message; a malformed attribute ends the
    search in its message."""
    out: Copies = []
    size = len(buf)
    pos = 0
    while pos + NLMSG_HDRLEN <= size:
        length = buf[pos] | buf[pos + 1] << 8 | buf[pos + 2] << 16 | buf[pos + 3] << 24
        kind = buf[pos + 4] | buf[pos + 5] << 8
        end = pos + length
        if length < NLMSG_HDRLEN or end > size:
            break
        prefix = b""
        payload = b""
        if kind == packet_type:
            at = pos + NLMSG_HDRLEN + NFGEN_LEN
            while at + 4 <= end:
                alen = buf[at] | buf[at + 1] << 8
                akind = (buf[at + 2] | buf[at + 3] << 8) & ATTR_TYPE_MASK
                if alen < 4 or at + alen > end:
                    break
                if akind == ATTR_PREFIX:
                    prefix = buf[at + 4 : at + alen]
                elif akind == ATTR_PAYLOAD:
                    payload = buf[at + 4 : at + alen]
                at += (alen + 3) & ~3
        if kind != NLMSG_DONE:
            out.append((kind, pos + NLMSG_HDRLEN, end, prefix, payload))
        pos += (length + 3) & ~3
    return out


def udp4_payload(raw: bytes) -> bytes | None:
    """The payload of an unfragmented IPv4 UDP packet, or None for anything else: the
    observer's cheap look at a DNS copy before it decides to parse the packet whole."""
    if len(raw) < 28 or raw[0] >> 4 != 4 or raw[9] != 17 or raw[6] & 0x3F or raw[7]:
        return None
    ihl = (raw[0] & 0x0F) * 4
    if ihl < 20 or len(raw) < ihl + 8:
        return None
    length = (raw[ihl + 4] << 8) | raw[ihl + 5]
    if length < 8:
        return None
    return raw[ihl + 8 : ihl + length]
