"""NflogListener's reading of what the kernel sends (kernel.nflog), on a socketpair
carrying hand-built nfnetlink_log messages: the observer's sift hook asked only in
order, once a datagram, and a read bounded by the messages it handled, sifted ones
included."""

from __future__ import annotations

import socket
import struct
import sys
from collections.abc import Callable

import pytest

from egress.datapath.nflog_wire import Copies
from egress.kernel import nflog
from egress.kernel.nflog import NflogListener
from egress.kernel.nfnetlink import HDR
from tests.support.nflog import GROUP, copy


def sifter(
    asked: list[bytes], deals: Callable[[bytes], bool], calls: list[int] | None = None
) -> Callable[[Copies], int]:
    """A sift hook that asks ``deals`` about each copy's prefix in turn and stops at the
    first it does not deal with; ``asked`` gets each prefix asked about, ``calls`` how
    many copies each call was given."""

    def sift(copies: Copies) -> int:
        if calls is not None:
            calls.append(len(copies))
        for i, (_, _, _, prefix, _packet) in enumerate(copies):
            asked.append(prefix)
            if not deals(prefix):
                return i
        return len(copies)

    return sift


def listener() -> tuple[NflogListener, socket.socket]:
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours.setblocking(False)
    return NflogListener(ours, GROUP, None), kernel


def test_a_read_stops_after_its_budget_of_messages_sifted_ones_included() -> None:
    nl, kernel = listener()
    asked: list[bytes] = []
    nl.sift = sifter(asked, lambda prefix: True)
    try:
        for _ in range(8):  # a unix datagram queue holds 10 (net.unix.max_dgram_qlen)
            kernel.send(copy(b"egress dns"))
        assert nl.read_events(3) == []
        assert len(asked) == 3  # the rest wait for the next read
        assert nl.read_events(1000) == [] and len(asked) == 8
    finally:
        nl.release()
        kernel.close()


def test_the_sift_hook_is_not_asked_about_a_copy_behind_an_event() -> None:
    """A reader acting on a copy at once (the observer binds an answer's names) must not
    act on it before the events ahead of it (a segment judged against the bindings)."""
    nl, kernel = listener()
    asked: list[bytes] = []
    nl.sift = sifter(asked, lambda prefix: prefix.startswith(b"egress dns"))
    try:
        kernel.send(copy(b"egress dns answer"))  # nothing ahead: dealt with by the hook
        kernel.send(copy(b"egress first_bytes"))
        kernel.send(copy(b"egress dns answer"))  # behind an event: an event too
        events = nl.read_events()
        assert [e.prefix for e in events] == ["egress first_bytes", "egress dns answer"]
        assert asked == [b"egress dns answer\0", b"egress first_bytes\0"]
    finally:
        nl.release()
        kernel.close()


def test_in_a_batch_of_copies_the_hook_is_asked_only_ahead_of_the_first_event() -> None:
    """The kernel sends the observer's copies 64 to a datagram: the order holds inside
    one, and what each datagram holds counts against the read's budget."""
    nl, kernel = listener()
    asked: list[bytes] = []
    calls: list[int] = []
    nl.sift = sifter(asked, lambda prefix: prefix.startswith(b"egress dns"), calls)
    try:
        kernel.send(copy(b"egress dns") + copy(b"egress first_bytes") + copy(b"egress dns"))
        events = nl.read_events()
        assert [e.prefix for e in events] == ["egress first_bytes", "egress dns"]
        assert asked == [b"egress dns\0", b"egress first_bytes\0"]
        for _ in range(3):
            kernel.send(copy(b"egress dns") * 4)
        assert nl.read_events(5) == [] and len(asked) == 2 + 8  # two datagrams: 8 >= 5
        assert nl.read_events(1000) == [] and len(asked) == 2 + 12
        assert calls == [3, 4, 4, 4]  # once a datagram, given all its copies
    finally:
        nl.release()
        kernel.close()


@pytest.mark.parametrize("order", ["little", "big"])
def test_the_decoder_for_a_big_endian_host_reads_the_same_events(
    order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``nflog_wire.walk`` reads netlink as little-endian; on a big-endian host the
    listener decodes each message whole instead (here: told the host is one, on
    little-endian messages), and must find the same events, the hook asked alike."""
    monkeypatch.setattr(sys, "byteorder", order)
    if order == "big":  # and walk is not what reads them
        monkeypatch.setattr(nflog, "walk", lambda buf, kind: pytest.fail("walk on big-endian"))
    nl, kernel = listener()
    asked: list[bytes] = []
    nl.sift = sifter(asked, lambda prefix: prefix == b"egress dns answer\0")
    try:
        kernel.send(copy(b"egress dns answer") + copy(b"egress dns") + copy(b"egress dns answer"))
        assert [e.prefix for e in nl.read_events()] == ["egress dns", "egress dns answer"]
        assert asked == [b"egress dns answer\0", b"egress dns\0"]
    finally:
        nl.release()
        kernel.close()


def test_without_a_hook_every_copy_is_an_event() -> None:
    nl, kernel = listener()
    try:
        for p in ("egress dns", "egress blocked_connect"):
            kernel.send(copy(p.encode()))
        assert [e.prefix for e in nl.read_events()] == ["egress dns", "egress blocked_connect"]
        assert struct.calcsize("=IHHII") == HDR.size
    finally:
        nl.release()
        kernel.close()


def test_what_the_kernel_flushes_as_the_binding_goes_is_read_not_closed_unread() -> None:
    """Unbinding flushes the batch the kernel held for the group into the socket ahead
    of its ack (the observer's copies are batched): ``unbind`` keeps them to be read."""
    nl, kernel = listener()
    asked: list[bytes] = []
    nl.sift = sifter(asked, lambda prefix: prefix.startswith(b"egress dns"))
    try:
        # The flushed batch, then the ack: read while the ack is awaited, the hook is
        # asked in order there too, and not behind the first event.
        for prefix in (b"egress dns answer", b"egress first_bytes", b"egress dns answer"):
            kernel.send(copy(prefix))
        seq = nl._seq + 1  # the unbind's
        kernel.send(HDR.pack(HDR.size + 4 + HDR.size, 2, 0, seq, 0) + struct.pack("=i", 0)
                    + HDR.pack(HDR.size, 0, 0, seq, 0))  # fmt: skip
        nl.unbind()
        assert kernel.recv(4096)  # the unbind request was sent
        assert [e.prefix for e in nl.read_events()] == ["egress first_bytes", "egress dns answer"]
        assert asked == [b"egress dns answer\0", b"egress first_bytes\0"]
        nl.close()  # unbound already: nothing is sent again
        kernel.setblocking(False)
        with pytest.raises(BlockingIOError):
            kernel.recv(4096)
    finally:
        nl.release()
        kernel.close()
