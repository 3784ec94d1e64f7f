"""SVCB and HTTPS records (RFC 9460) as a sandbox gets them: no ECH, no address hints.

An HTTPS answer can tell a client three things egress must not let it act on:

- ``ech`` (key 5): a key to encrypt its ClientHello to the server. An encrypted ClientHello
  hides the name the connection is for, the name egress binds a connection to; without
  the key, a client sends its SNI in the clear (and egress refuses an ECH ClientHello).
- ``ipv4hint``/``ipv6hint`` (keys 4, 6): addresses to connect to without asking A/AAAA. A
  sandbox's sets are filled from A/AAAA answers only, under the rule that allowed them, so
  a hinted address would be refused, and refusing freezes. Hints are optional (RFC 9460
  section 7.3): without them a client asks A/AAAA, which puts the addresses in the sets.
- ``port`` (key 3): another port than 443. A record whose port the rule does not allow is
  removed whole, so the client uses the name's A/AAAA records and its default port.

A record that lists a removed key as ``mandatory`` (key 0) is removed whole too: its
publisher said it is not usable without that key, and a client then proceeds as if there
were no HTTPS record. A record that does not parse is removed (clients must ignore one).
"""

from __future__ import annotations

import struct

from egress.model import Ports

MANDATORY, PORT, IPV4HINT, ECH, IPV6HINT = 0, 3, 4, 5, 6
REMOVED = frozenset({IPV4HINT, ECH, IPV6HINT})
_PARAM = struct.Struct("!HH")


class Malformed(ValueError):
    """SVCB rdata that does not parse: the record is to be ignored (RFC 9460 section 2.2)."""


def for_sandbox(rdata: bytes, ports: Ports) -> bytes | None:
    """``rdata`` without the removed keys, or None when the record must go (a removed key
    is mandatory, its port is not among ``ports``' TCP ports, or it does not parse)."""
    try:
        return _strip(rdata, ports)
    except Malformed:
        return None


def _strip(rdata: bytes, ports: Ports) -> bytes | None:
    pos = _target_end(rdata)
    kept = [rdata[:pos]]
    last = -1
    while pos < len(rdata):
        if pos + 4 > len(rdata):
            raise Malformed("SvcParam cut short")
        key, length = _PARAM.unpack_from(rdata, pos)
        end = pos + 4 + length
        if end > len(rdata):
            raise Malformed(f"SvcParam {key} runs past the record")
        if key <= last:
            raise Malformed("SvcParamKeys not in increasing order")
        last = key
        value = rdata[pos + 4 : end]
        if key == MANDATORY:
            if not length or length % 2:
                raise Malformed("mandatory list of odd length")
            if REMOVED.intersection(struct.unpack(f"!{length // 2}H", value)):
                return None
        elif key == PORT:
            if length != 2:
                raise Malformed("port of the wrong length")
            port = int.from_bytes(value, "big")
            if not ports.allows("tcp", port):
                return None
        if key not in REMOVED:
            kept.append(rdata[pos:end])
        pos = end
    return b"".join(kept)


def _target_end(rdata: bytes) -> int:
    """Offset just past SvcPriority and TargetName (never compressed, section 2.2)."""
    pos, total = 2, 0
    while True:
        if pos >= len(rdata):
            raise Malformed("TargetName cut short")
        n = rdata[pos]
        if n & 0xC0:
            raise Malformed("compressed or extended label in TargetName")
        pos += 1 + n
        total += 1 + n
        if total > 255 or pos > len(rdata):
            raise Malformed("TargetName too long or cut short")
        if n == 0:
            return pos
