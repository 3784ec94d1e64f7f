"""Answers kept as wire bytes, with the offsets of their TTLs, ready to patch and send.

A hit costs a dict lookup, a copy and a few ``pack_into``s: no dnslib objects. Negative
answers are kept as long as RFC 2308 allows (their SOA's TTL and MINIMUM). Entries also
remember until when the kernel allows their addresses, so a hit can refresh the set
before the sandbox uses an address the kernel would already have forgotten.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

from egress.datapath.elements import SetUpdate
from egress.model import IPAddress, Ports
from egress.resolver import wire

_TTL = struct.Struct("!I")
NO_PORTS = Ports()


@dataclass(slots=True)
class Entry:
    message: bytes  # the reply with ID 0, no OPT, the question in lowercase
    ttl_offsets: tuple[int, ...]
    ttls: tuple[int, ...]
    stored_at: float
    expires_at: float
    update: SetUpdate | None  # the elements this answer allows (None: no addresses)
    allowed_until: float  # when the kernel's set elements for them expire
    ips: tuple[IPAddress, ...] = ()  # the addresses ``update`` allows
    ede: bytes = b""  # an Extended DNS Error option for EDNS clients (a refusal's reason)
    names: tuple[str, ...] = ()  # the question and its CNAME chain: what ``ips`` answer for
    ports: Ports = NO_PORTS  # where ``update`` lets them be reached (its rule's ports)
    checked: bool = True  # its rule's check_names: flows to ``ips`` are bound to ``names``

    def remaining(self, now: float) -> int:
        return max(0, int(self.expires_at - now))


class Cache:
    """Bounded LRU keyed by the lowercased question section (name, type, class)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, now: float) -> Entry | None:
        entry = self._entries.get(key)
        if entry is None or entry.expires_at <= now:
            if entry is not None:
                del self._entries[key]
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def holds(self, key: bytes, entry: Entry) -> bool:
        """Is ``entry`` the one stored under ``key`` (expired or not)? No LRU move."""
        return self._entries.get(key) is entry

    def touch(self, key: bytes, entry: Entry) -> bool:
        """``holds``, and if so ``entry`` moves to the fresh end, as a hit would."""
        if not self.holds(key, entry):
            return False
        self._entries.move_to_end(key)
        return True

    def put(self, key: bytes, entry: Entry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


def make_entry(
    message: bytes,
    offsets: list[int],
    ttl: int,
    now: float,
    update: SetUpdate | None,
    allowed_s: int,
    ips: tuple[IPAddress, ...] = (),
    ede: bytes = b"",
    names: tuple[str, ...] = (),
    ports: Ports = NO_PORTS,
    checked: bool = True,
) -> Entry:
    """``offsets``: where the message's TTLs are (``wire.ttl_offsets`` finds them)."""
    ttls = tuple(_TTL.unpack_from(message, off)[0] for off in offsets)
    return Entry(message, tuple(offsets), ttls, now, now + ttl, update, now + allowed_s, ips,
                 ede, names, ports, checked)  # fmt: skip


def render(entry: Entry, query: wire.Query, now: float, max_size: int) -> bytes:
    """The cached answer for this client: its ID, flags, question case, EDNS; TTLs aged."""
    out = bytearray(entry.message)
    qid_flags = struct.unpack_from("!H", out, 2)[0]
    flags = wire.reply_flags(query.flags, qid_flags & 0xF)
    struct.pack_into("!HH", out, 0, query.id, flags)
    out[12 : 12 + len(query.question)] = query.question
    _age_ttls(out, entry, now, 0)
    if query.edns_size is not None:
        out += wire.opt_record(options=entry.ede)
        struct.pack_into("!H", out, 10, struct.unpack_from("!H", out, 10)[0] + 1)
    if len(out) > max_size:
        return truncated(query)
    return bytes(out)


def aged(entry: Entry, tail: bytes, now: float) -> bytes:
    """``render(entry, q, t, size)[2:]`` (a reply after its ID) as ``render`` gives it for
    the same query at ``now``: only the TTLs differ, and every one of them lies before the
    OPT record ``render`` appends, at the entry's offsets. A truncated reply (TC) carries
    the question alone: nothing in it ages."""
    if struct.unpack_from("!H", tail)[0] & wire.TC:
        return tail
    out = bytearray(tail)
    _age_ttls(out, entry, now, -2)
    return bytes(out)


def _age_ttls(out: bytearray, entry: Entry, now: float, shift: int) -> None:
    """The entry's TTLs in ``out`` (its message from byte ``-shift`` on), aged to ``now``."""
    age = int(now - entry.stored_at)
    for off, ttl in zip(entry.ttl_offsets, entry.ttls, strict=True):
        _TTL.pack_into(out, off + shift, max(0, ttl - age))


def truncated(query: wire.Query) -> bytes:
    """TC=1 with the question only: the client asks again over TCP."""
    opt = query.edns_size is not None
    flags = wire.reply_flags(query.flags, wire.NOERROR) | wire.TC
    head = wire.HEADER.pack(query.id, flags, 1, 0, 0, 1 if opt else 0)
    return head + query.question + (wire.opt_record() if opt else b"")
