"""datapath.nflog_wire.walk: each NFLOG copy's prefix and payload, found in one pass,
exactly as decoding every message's attributes into a dict finds them (the kernel
adapter's ``messages`` and ``iter_attrs``), on well-formed, odd and damaged buffers.

Runs on the compiled module when it is built (``make test`` runs it again with
``EGRESS_NATIVE=0``, on the sources)."""

from __future__ import annotations

import random
import struct

from egress.datapath.nflog_wire import Copies, walk
from egress.kernel.nfnetlink import HDR, NFGEN, attr, iter_attrs, messages
from tests.support.nflog import PACKET, QUERY, copy

CONFIG = (4 << 8) | 1
DONE, ERROR = 3, 2


def reference(buf: bytes, packet_type: int = PACKET) -> Copies:
    out = []
    for kind, _seq, pos, end in messages(buf):
        attrs = iter_attrs(buf, pos + NFGEN.size, end) if kind == packet_type else {}
        out.append((kind, pos, end, attrs.get(10, b""), attrs.get(9, b"")))
    return out


def test_each_copy_gives_its_prefix_and_payload() -> None:
    buf = copy(b"egress dns", QUERY) + copy(b"egress dns answer", QUERY[:33]) + copy(None, b"x")
    assert walk(buf, PACKET) == reference(buf)
    assert [(p, len(d)) for _, _, _, p, d in walk(buf, PACKET)] == [
        (b"egress dns\0", len(QUERY)),
        (b"egress dns answer\0", 33),
        (b"", 1),
    ]


def test_other_messages_are_listed_without_attributes_and_done_is_not() -> None:
    done = HDR.pack(HDR.size + 4, DONE, 0, 0, 0) + b"\0" * 4
    error = HDR.pack(HDR.size + 4, ERROR, 0, 9, 0) + struct.pack("=i", 0)
    buf = error + copy(b"egress dns", QUERY, kind=CONFIG) + done + copy(b"egress dns", b"q")
    found = walk(buf, PACKET)
    assert found == reference(buf)
    assert [(k, p, d) for k, _, _, p, d in found] == [
        (ERROR, b"", b""),
        (CONFIG, b"", b""),
        (PACKET, b"egress dns\0", b"q"),
    ]


def test_flag_bits_in_an_attribute_type_and_a_repeated_attribute() -> None:
    nested = struct.pack("=HH", 8, 10 | 0x8000) + b"abc\0"  # NLA_F_NESTED on a prefix
    buf = copy(b"first", b"one", extra=nested + attr(9, b"two"))
    assert walk(buf, PACKET) == reference(buf)
    assert walk(buf, PACKET)[0][3:] == (b"abc\0", b"one")  # the last of each kind


def test_a_damaged_attribute_ends_its_message_and_a_damaged_message_the_walk() -> None:
    good = copy(b"egress dns", QUERY)
    short = bytearray(copy(b"egress dns", QUERY))
    struct.pack_into("=H", short, HDR.size + NFGEN.size + 8, 2)  # the prefix says 2 bytes
    long = bytearray(copy(b"egress dns", QUERY))
    struct.pack_into("=H", long, HDR.size + NFGEN.size, 0xFFF0)  # past the message's end
    for buf in (bytes(short) + good, bytes(long) + good):
        assert walk(buf, PACKET) == reference(buf)
        assert walk(buf, PACKET)[0][3:] == (b"", b"")
        assert walk(buf, PACKET)[1][3:] == (b"egress dns\0", QUERY)
    tiny = HDR.pack(HDR.size + 2, PACKET, 0, 0, 0) + b"\0\0"  # no room for nfgenmsg
    cut = good + good[:-5]  # the last message runs past the buffer
    for buf in (tiny + good, cut, good + HDR.pack(8, PACKET, 0, 0, 0), b"", b"\0" * 15):
        assert walk(buf, PACKET) == reference(buf)
    assert len(walk(cut, PACKET)) == 1 and walk(tiny + good, PACKET) == reference(tiny)


def test_random_damage_finds_what_the_dict_decoder_finds() -> None:
    rng = random.Random(17)
    base = [copy(b"egress dns", QUERY), copy(b"egress dns answer", QUERY + b"\1" * 40),
            copy(b"egress first_bytes", rng.randbytes(300)), copy(None, None)]  # fmt: skip
    for _ in range(4000):
        buf = bytearray(b"".join(rng.choice(base) for _ in range(rng.randint(1, 5))))
        for _ in range(rng.randint(0, 6)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        if rng.random() < 0.2:
            del buf[rng.randrange(len(buf)) :]
        data = bytes(buf)
        assert walk(data, PACKET) == reference(data), data.hex()
