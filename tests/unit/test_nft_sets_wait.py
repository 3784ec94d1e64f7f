"""``NetlinkSets``' waits: its socket is non-blocking and it tries each call first, so the
waits it does are its own. A datagram socket pair stands in for nf_tables here (the real
kernel's acks: tests/privileged/test_nft.py): an ack that comes late is still read, one
that never comes fails in SET_UPDATE_DEADLINE_S, and an earlier batch's ack is skipped."""

from __future__ import annotations

import errno
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from egress.kernel.nft_sets import SET_UPDATE_DEADLINE_S, NetlinkSets

ELEMENT = ("192.0.2.1 . tcp . 443",)


@pytest.fixture
def pair() -> Iterator[tuple[NetlinkSets, socket.socket]]:
    sets = NetlinkSets(None)
    # Non-blocking, as the stand-in below: a blocking socket would wait for a lost ack
    # forever, and one with a timeout polls before each call.
    assert sets._sock.gettimeout() == 0.0
    sets.close()
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours.setblocking(False)
    sets._sock = ours  # the writer's socket, as NetlinkSets made its own
    kernel.settimeout(5)
    try:
        yield sets, kernel
    finally:
        ours.close()
        kernel.close()


def ack(seq: int, err: int = 0) -> bytes:
    """An NLMSG_ERROR message: header, error code, the request's header (zeros here)."""
    return struct.pack("=IHHII", 36, 2, 0, seq, 0) + struct.pack("=i", err) + bytes(16)


def request_seq(batch: bytes) -> int:
    """The sequence number of the batch's request (its second message; the first begins
    the batch)."""
    first = struct.unpack_from("=I", batch)[0]
    return int(struct.unpack_from("=I", batch, first + (-first % 4) + 8)[0])


def answer_later(kernel: socket.socket, replies: list[bytes] | None, delay: float) -> None:
    """Read the batch, wait ``delay``, then send ``replies`` (None: acks of an earlier
    batch, then this one's)."""
    seq = request_seq(kernel.recv(65536))
    time.sleep(delay)  # the ack comes after the writer found none and began its wait
    for reply in replies if replies is not None else [ack(seq - 3), ack(seq)]:
        kernel.send(reply)


def test_an_ack_that_comes_late_is_read(pair: tuple[NetlinkSets, socket.socket]) -> None:
    sets, kernel = pair
    t = threading.Thread(target=answer_later, args=(kernel, None, SET_UPDATE_DEADLINE_S / 4))
    t.start()
    try:
        sets.add("allow4", ELEMENT, 60)  # returns: the earlier batch's ack was skipped
    finally:
        t.join()


def test_no_ack_fails_at_the_deadline(pair: tuple[NetlinkSets, socket.socket]) -> None:
    sets, kernel = pair
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        sets.add("allow4", ELEMENT, 60)
    waited = time.monotonic() - start
    assert waited >= SET_UPDATE_DEADLINE_S * 0.9  # it waited, and then gave up
    assert waited < 5  # and did not block
    assert request_seq(kernel.recv(65536)) > 0  # the batch itself was sent


def test_a_refusal_is_the_kernels_error(pair: tuple[NetlinkSets, socket.socket]) -> None:
    sets, kernel = pair
    refused: list[bytes] = []

    def refuse() -> None:
        seq = request_seq(kernel.recv(65536))
        refused.append(ack(seq, -errno.ENOENT))
        kernel.send(refused[0])

    t = threading.Thread(target=refuse)
    t.start()
    try:
        with pytest.raises(OSError) as raised:
            sets.delete("allow4", ELEMENT)
    finally:
        t.join()
    assert raised.value.errno == errno.ENOENT
