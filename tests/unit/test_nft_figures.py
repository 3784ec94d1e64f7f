"""kernel/nft_figures.py's reading of the kernel's answers, fed as the kernel sends them:
a dump over several reads, a dump that fails part way, a counter object and its ack."""

from __future__ import annotations

import errno
import struct

import pytest

from egress.errors import DatapathError
from egress.kernel import nft_figures as nf
from egress.kernel.nfnetlink import HDR, NLM_F_DUMP_INTR, NLMSG_DONE, NLMSG_ERROR, attr, message


class FakeSocket:
    """Hands out the queued reads in turn, whatever was sent (the request's seq is 1)."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> int:
        self.sent.append(data)
        return len(data)

    def recv(self, size: int) -> bytes:
        return self.reads.pop(0)


def reader(reads: list[bytes]) -> nf.Reader:
    r = nf.Reader.__new__(nf.Reader)
    r._sock = FakeSocket(reads)  # type: ignore[assignment]
    r._table = b"egress\0"
    r._seq = 0
    return r


def elements(n: int, seq: int = 1) -> bytes:
    """A NEWSETELEM message of n elements (each a key, as the kernel nests them)."""
    items = b"".join(attr(nf._LIST_ELEM | 0x8000, attr(1 | 0x8000, attr(1, b"\1" * 12)))
                     for _ in range(n))  # fmt: skip
    body = attr(nf._LIST_TABLE, b"egress\0") + attr(nf._LIST_SET, b"allow4\0")
    body += attr(nf._LIST_ELEMENTS | 0x8000, items)
    return message(nf._NEWSETELEM, 2, seq, 1, 0, body)


def done(seq: int = 1, err: int = 0) -> bytes:
    return HDR.pack(HDR.size + 4, NLMSG_DONE, 2, seq, 0) + struct.pack("=i", err)


def test_a_dump_over_several_reads_counts_every_element() -> None:
    r = reader([elements(3) + elements(2), elements(4) + done()])
    assert r.set_size("allow4") == 9


def test_a_dump_that_fails_part_way_is_an_error_not_a_smaller_set() -> None:
    r = reader([elements(3), done(err=-errno.ENOENT)])
    with pytest.raises(DatapathError, match="set allow4: No such file"):
        r.set_size("allow4")


def test_an_answer_to_an_earlier_request_is_skipped() -> None:
    r = reader([elements(5, seq=7) + elements(1) + done()])
    assert r.set_size("allow4") == 1


def test_a_counter_objects_packets_then_its_ack() -> None:
    data = attr(1, struct.pack("!Q", 999)) + attr(nf._COUNTER_PACKETS, struct.pack("!Q", 42))
    obj = message(nf._NEWOBJ, 0, 1, 1, 0, attr(nf._OBJ_DATA | 0x8000, data))
    ack = HDR.pack(HDR.size + 4, NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", 0)
    assert reader([obj + ack]).counter_packets("dropped") == 42
    missing = HDR.pack(HDR.size + 4, NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -errno.ENOENT)
    with pytest.raises(DatapathError, match="counter dropped: No such file"):
        reader([missing]).counter_packets("dropped")


def test_a_sets_elements_their_keys_and_the_seconds_they_have_left() -> None:
    """Each element's key (its concatenation's fields, each padded to 4 bytes) and its
    expiration (ms, big-endian), as an observer reads the allow sets at its start."""

    def element(key: bytes, expires_ms: int | None) -> bytes:
        fields = attr(nf._ELEM_KEY | 0x8000, attr(nf._DATA_VALUE, key))
        if expires_ms is not None:
            fields += attr(4, struct.pack("!Q", 30_000))  # its timeout, not its end
            fields += attr(nf._ELEM_EXPIRATION, struct.pack("!Q", expires_ms))
        return attr(nf._LIST_ELEM | 0x8000, fields)

    v4 = bytes([192, 0, 2, 10]) + b"\6\0\0\0" + b"\1\xbb\0\0"
    items = element(v4, 12_345) + element(b"\xc6\x13\0\1" + b"\0" * 8, None)
    body = attr(nf._LIST_TABLE, b"egress\0") + attr(nf._LIST_SET, b"allow4\0")
    body += attr(nf._LIST_ELEMENTS | 0x8000, items)
    dump = message(nf._NEWSETELEM, 2, 1, 1, 0, body)
    got = reader([dump + elements(1) + done()]).elements("allow4")
    assert got == [(v4, 12.345), (b"\xc6\x13\0\1" + b"\0" * 8, 0.0), (b"\1" * 12, 0.0)]


def test_a_set_that_is_not_there_has_no_elements_and_other_errors_say_so() -> None:
    assert reader([done(err=-errno.ENOENT)]).elements("allow6") == []
    with pytest.raises(DatapathError, match="set allow4: Operation not permitted"):
        reader([done(err=-errno.EPERM)]).elements("allow4")


def test_a_dump_the_ruleset_changed_under_is_asked_again() -> None:
    """NLM_F_DUMP_INTR on a dump's message: an element may be missing from it (the
    resolver adds them all the time). The set is dumped again, up to DUMP_TRIES."""

    def interrupted(data: bytes) -> bytes:
        length, kind, flags, seq, pid = HDR.unpack_from(data)
        return HDR.pack(length, kind, flags | NLM_F_DUMP_INTR, seq, pid) + data[HDR.size :]

    first = interrupted(elements(1)) + done()
    second = elements(2, seq=2) + done(seq=2)
    r = reader([first, second])
    assert len(r.elements("allow4")) == 2 and not r.interrupted
    always = [interrupted(elements(1, seq=n)) + done(seq=n) for n in (1, 2, 3)]
    r = reader(always)
    assert len(r.elements("allow4")) == 1 and r.interrupted  # the last one's, said so
