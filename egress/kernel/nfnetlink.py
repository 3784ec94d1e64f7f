"""A raw NETLINK_NETFILTER socket bound to one subsystem's resource: what NFLOG and
NFQUEUE listeners share.

pyroute2 0.9.7 speaks neither nfnetlink_log nor nfnetlink_queue, so both listeners build
their messages by hand: a netlink header, an ``nfgenmsg`` naming the resource (an NFLOG
group, a queue number), attributes. This holds the rest: the socket opened under
``in_netns`` (both are per netns), a receive buffer that bursts do not overflow, config
messages sent with an ack and awaited, draining without blocking (ENOBUFS counted in
``overruns``: the kernel dropped what it could not hand over), and a close that unbinds
unless another process shares the socket (egressd handing over). Not thread-safe.
One request and its answer, ``exchange``, serves ``kernel.nft_figures`` and
``kernel.conntrack``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from typing import Generic, TypeVar

from egress.errors import DatapathError
from egress.kernel.netns import in_netns

NETLINK_NETFILTER = 12
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300  # NLM_F_ROOT | NLM_F_MATCH
NLM_F_DUMP_INTR = 0x10  # on a dump's message: what it lists changed while it was made
HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
NFGEN = struct.Struct("!BBH")  # nfgenmsg: family, version, res_id (big endian)
RECV_SIZE = 1 << 17  # a whole GSO packet (64 KiB) plus the headers
_SO_RCVBUFFORCE = 33  # not exported by the socket module

T = TypeVar("T")


def attr(kind: int, data: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(data), kind) + data
    return raw + b"\0" * (-len(raw) % 4)


def message(kind: int, flags: int, seq: int, family: int, res_id: int, body: bytes) -> bytes:
    """A netfilter netlink message: header, ``nfgenmsg`` (family, res_id), body."""
    payload = NFGEN.pack(family, 0, res_id) + body
    return HDR.pack(HDR.size + len(payload), kind, flags, seq, 0) + payload


def iter_attrs(buf: bytes, pos: int, end: int) -> dict[int, bytes]:
    attrs: dict[int, bytes] = {}
    while pos + 4 <= end:
        length, kind = struct.unpack_from("=HH", buf, pos)
        if length < 4 or pos + length > end:
            break
        attrs[kind & 0x3FFF] = buf[pos + 4 : pos + length]
        pos += (length + 3) & ~3
    return attrs


def be32(attrs: dict[int, bytes], kind: int) -> int | None:
    raw = attrs.get(kind)
    return struct.unpack("!I", raw[:4])[0] if raw is not None and len(raw) >= 4 else None


def messages(buf: bytes, done: bool = False) -> list[tuple[int, int, int, int]]:
    """(type, seq, payload start, payload end) of each netlink message in buf; a dump's
    NLMSG_DONE too with ``done`` (its payload: the dump's error, 0 or negative)."""
    out = []
    pos = 0
    while pos + HDR.size <= len(buf):
        length, kind, _flags, seq, _pid = HDR.unpack_from(buf, pos)
        if length < HDR.size or pos + length > len(buf):
            break
        if done or kind != NLMSG_DONE:
            out.append((kind, seq, pos + HDR.size, pos + length))
        pos += (length + 3) & ~3
    return out


Answer = list[tuple[int, bytes, int, int]]  # (type, buffer, payload start, payload end)


def exchange(sock: socket.socket, msg: bytes, seq: int) -> tuple[Answer, int, bool]:
    """Send one request (``msg``, numbered ``seq``) and read its answer up to its end, a
    dump's NLMSG_DONE or a request's ack: the messages before that end; the end's error
    (0, or a positive errno; a dump that failed part way ends with DONE carrying it);
    whether the kernel flagged the dump interrupted (NLM_F_DUMP_INTR). Messages of
    earlier requests are skipped; the socket's OSError (a timeout too) is the caller's."""
    sock.send(msg)
    out: Answer = []
    interrupted = False
    while True:
        buf = sock.recv(1 << 16)
        for got, got_seq, start, end in messages(buf, done=True):
            if got_seq != seq:
                continue
            if HDR.unpack_from(buf, start - HDR.size)[2] & NLM_F_DUMP_INTR:
                interrupted = True
            if got in (NLMSG_DONE, NLMSG_ERROR):
                err = -struct.unpack_from("=i", buf, start)[0] if end - start >= 4 else 0
                return out, err, interrupted
            out.append((got, buf, start, end))


def open_socket(netns: str | None) -> socket.socket:
    try:
        with in_netns(netns):
            return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    except OSError as exc:
        raise DatapathError(f"cannot open an nfnetlink socket: {exc}") from exc


class NfnlListener(Generic[T]):
    """One bound resource (``res_id``) of one nfnetlink subsystem in one netns. A
    subclass names its subsystem and config message, decodes what the kernel sends
    (``_decode`` a message, ``_decode_all`` a whole read, which by default calls
    ``_decode`` for each) and says how to unbind (``_unbind_attrs``)."""

    SUBSYS = 0
    CONFIG_MSG = 0
    KIND = "nfnetlink"  # for messages: "NFLOG group", "NFQUEUE"

    def __init__(self, sock: socket.socket, res_id: int, netns: str | None) -> None:
        self._sock: socket.socket | None = sock
        self._res_id = res_id
        self.netns = netns
        self.overruns = 0
        # Another process holds this same socket (egressd handing over, or handed over
        # to): closing must not unbind under it. The kernel drops the binding when the
        # last descriptor of the socket closes anyway.
        self.shared = False
        self._unbound = False  # unbind() was sent
        self._seq = 0
        self._pending: list[T] = []
        # The items decoded so far in this read, ahead of the message being decoded.
        self._ahead: list[T] = self._pending

    def _where(self) -> str:
        return f"{self.KIND} {self._res_id} in {self.netns or 'the current netns'}"

    def _bind_socket(self, rcvbuf: int) -> None:
        sock = self._require()
        sock.bind((0, 0))
        try:
            # FORCE lets root exceed net.core.rmem_max: a burst must not overflow.
            sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, rcvbuf)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)

    def _require(self) -> socket.socket:
        if self._sock is None:
            raise DatapathError(f"{self.KIND} listener is closed")
        return self._sock

    def _message(self, msg_type: int, flags: int, attrs: bytes) -> bytes:
        self._seq += 1
        return message(msg_type, flags, self._seq, socket.AF_UNSPEC, self._res_id, attrs)

    def _config(self, what: str, attrs: bytes) -> None:
        """Send a config message for our resource and wait for the kernel's ack."""
        sock = self._require()
        msg_type = (self.SUBSYS << 8) | self.CONFIG_MSG
        try:
            sock.send(self._message(msg_type, NLM_F_REQUEST | NLM_F_ACK, attrs))
            sock.settimeout(2.0)
            self._await_ack(sock, what)
        except OSError as exc:
            raise DatapathError(f"{self._where()}: {what}: {exc}") from exc
        finally:
            sock.setblocking(False)

    def _await_ack(self, sock: socket.socket, what: str) -> None:
        while True:
            try:
                buf = sock.recv(RECV_SIZE)
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise  # includes the timeout
                self.overruns += 1  # copies lost while we waited; the ack still comes
                continue
            for kind, seq, pos, end in messages(buf):
                if kind == NLMSG_ERROR and seq == self._seq:
                    err = -struct.unpack_from("=i", buf, pos)[0]
                    if err:
                        raise DatapathError(f"{self._where()}: {what}: {os.strerror(err)}")
                    return
                self._ahead = self._pending
                self._pending.extend(self._decode(kind, buf, pos, end))

    def _drain(self, max_items: int) -> list[T]:
        """What is ready now, without blocking: up to about ``max_items`` messages, those a
        subclass dealt with itself included (so one busy socket cannot hold its reader,
        and whoever else it serves, for as long as the sender keeps it full)."""
        sock = self._require()
        items, self._pending = self._pending, []
        self._ahead = items
        handled = 0
        while handled < max_items:
            try:
                buf = sock.recv(RECV_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise DatapathError(f"{self._where()}: receive: {exc}") from exc
                self.overruns += 1
                continue
            handled += self._decode_all(buf, items)
        return items

    def _decode_all(self, buf: bytes, items: list[T]) -> int:
        """Append what each message of ``buf`` is to ``items``; how many messages it held."""
        found = messages(buf)
        for kind, _seq, pos, end in found:
            items.extend(self._decode(kind, buf, pos, end))
        return len(found)

    def _decode(self, kind: int, buf: bytes, pos: int, end: int) -> list[T]:
        raise NotImplementedError

    def _unbind_attrs(self) -> bytes:
        raise NotImplementedError

    def fileno(self) -> int:
        return self._require().fileno()

    @property
    def sock(self) -> socket.socket:
        """The bound socket itself (egressd hands it to its successor)."""
        return self._require()

    def release(self) -> None:
        """Close our descriptor but keep the binding: another process holds the same
        socket and goes on reading it."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def unbind(self) -> None:
        """Give up the binding but keep the socket open to be read: what the kernel still
        held for it (a batch it flushes as the binding goes, before its ack) is then read
        by ``_drain`` instead of closed unread. Nothing to do for a shared listener."""
        if self._sock is None or self.shared or self._unbound:
            return
        self._unbound = True
        with contextlib.suppress(DatapathError):  # closing the socket releases it as well
            self._config("unbind", self._unbind_attrs())

    def close(self) -> None:
        """Unbind (so another listener may bind) and close the socket."""
        if self._sock is None:
            return
        if self.shared:
            self.release()
            return
        try:
            self.unbind()
        finally:
            self.release()
