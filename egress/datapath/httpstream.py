"""The client half of a plain-HTTP/1.x connection, read request by request.

``firstbytes`` reads a flow's first request. Over plain HTTP that is not enough: a
kept-alive or pipelined connection carries more requests, each with a Host of its own,
and the server answers each for the name it names. So a plain-HTTP flow is read for its
whole life: every request head is judged as the first one was, and the bytes between
heads are framed as the server frames them (RFC 9112 section 6), so that the next head
is looked for exactly where the server will look for it:

- ``Transfer-Encoding: chunked``: chunk-size lines, chunk data, the CRLF after each,
  the trailer section. Only ``chunked`` alone, and only on HTTP/1.1;
- ``Content-Length``: that many bytes. One value, or several that are the same, in
  ASCII digits;
- neither: no body (a request has none unless it says so).

Anything two servers could frame differently is refused, never guessed: both headers at
once, another transfer coding, a size line with whitespace, a ``0x``, a lone CR or LF,
or more than 16 hex digits, chunk data not followed by CRLF. Between requests, up to
``MAX_EMPTY_LINES`` empty lines (CRLF) are skipped, as servers skip them; any other byte
must start an HTTP/1.x head.

After a ``CONNECT`` or an ``Upgrade`` request the server may leave HTTP (a tunnel, a
WebSocket), or may not and read what follows as requests. Only its answer says which,
and this reads only the client's bytes; nor is there a first byte that tells: Netty
skips every byte up to 0x20 before a request line, nginx and Node a CR or LF, Python's
``http.server`` whitespace (0x85 and 0xA0 among it), and a TLS record's fields can be
chosen to be such bytes and its random to be a request. So the bytes after such a
request are read as requests too: a tunnel or WebSocket over plain HTTP on a checked
port is refused (its traffic is no request), as is cleartext HTTP/2 after
``Upgrade: h2c`` (its preface, which ``firstbytes`` refuses as it refuses prior
knowledge). Over TLS, or through a rule with ``check_names: false``, they pass.

What this does not see: a server that leaves a request's declared body unread and keeps
the connection reads that body as requests (Python's ``http.server`` with a handler that
does not read it is one). The body is the server's to consume; this frames it as the
protocol says.

Pure and incremental: ``feed`` the bytes in order as they come, and get back each head
completed in them, as ``firstbytes`` judges it, and how many bytes at the end are not
judged yet (an unfinished head, size line or trailer). ``framing`` lists where the
bytes that decide framing lie, so that a retransmission of them can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from egress.datapath.firstbytes import (
    MAX_HEAD,
    METHODS,
    FirstBytes,
    Outcome,
    _refuse,
    field_line_problem,
    judge,
    lone_line_end,
)

MAX_SIZE_LINE = 1024  # a chunk-size line with its extensions
MAX_EMPTY_LINES = 4  # CRLFs between two requests (clients send one at most, after a body)
MAX_HEX = 16  # hex digits in a chunk size
MAX_LENGTH_DIGITS = 15  # a Content-Length of up to 10^15 - 1 bytes
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")
# A chunk extension's bytes (RFC 9112 7.1.1): tokens, "=", quoted strings without
# whitespace. Servers differ on whitespace around them, so there is none.
_EXT = frozenset(range(0x21, 0x7F))
_LONE = "a chunk-size line ended by a lone CR or LF"
_AFTER_SWITCH = (" after CONNECT or Upgrade (a tunnel or WebSocket over plain HTTP is not "
                 "read: use TLS, or a rule with check_names: false)")  # fmt: skip


class _State(Enum):
    HEAD = "head"  # reading a request head (or the empty lines before one)
    BODY = "body"  # ``left`` bytes of a Content-Length body
    SIZE = "size"  # a chunk-size line
    DATA = "data"  # ``left`` bytes of chunk data
    DATA_END = "data_end"  # the CRLF after chunk data
    TRAILER = "trailer"  # the trailer section after the last chunk
    REFUSED = "refused"  # a refusal was given: nothing more is read


@dataclass(frozen=True, slots=True)
class Step:
    """What one ``feed`` found."""

    heads: tuple[FirstBytes, ...]  # each head completed, in order; a REFUSE ends the list
    pending: int  # bytes at the end not judged yet: held until they are
    # (offset, length) in the stream of the bytes that say where requests begin and end:
    # heads, empty lines, size lines, the CRLF after chunk data, trailers
    framing: tuple[tuple[int, int], ...]

    @property
    def refusal(self) -> FirstBytes | None:
        last = self.heads[-1] if self.heads else None
        return last if last is not None and last.outcome is Outcome.REFUSE else None


@dataclass(frozen=True, slots=True)
class _Framing:
    chunked: bool
    length: int
    switches: bool  # CONNECT or Upgrade: the server may leave HTTP after it (not read)


class RequestStream:
    """One connection's client bytes, in order, from its first byte."""

    def __init__(self) -> None:
        self._state = _State.HEAD
        self._buf = bytearray()  # the unfinished head, size line or trailer
        self._left = 0  # BODY, DATA: bytes still to come
        self._empty = 0  # empty lines since the last head
        self._switched = False  # the last head was CONNECT or Upgrade
        self.offset = 0  # bytes fed so far
        self.requests = 0  # heads judged

    @property
    def pending(self) -> int:
        """Bytes at the end not judged yet (an unfinished head, size line or trailer)."""
        if self._state in (_State.HEAD, _State.SIZE, _State.TRAILER, _State.DATA_END):
            return len(self._buf)
        return 0

    def feed(self, data: bytes) -> Step:
        heads: list[FirstBytes] = []
        framing: list[tuple[int, int]] = []
        pos = 0
        while pos < len(data) and self._state is not _State.REFUSED:
            state = self._state
            if state in (_State.BODY, _State.DATA):
                take = min(self._left, len(data) - pos)
                self._left -= take
                pos += take
                if self._left == 0:
                    self._state = _State.DATA_END if state is _State.DATA else _State.HEAD
            else:
                pos = self._framed(data, pos, heads, framing)
        self.offset += len(data)
        return Step(tuple(heads), self.pending, _merge(framing))

    def _framed(
        self,
        data: bytes,
        pos: int,
        heads: list[FirstBytes],
        framing: list[tuple[int, int]],
    ) -> int:
        """Read framing bytes (a head, a size line, a trailer) from ``data[pos:]`` into the
        buffer; act on them once complete. Returns where it stopped."""
        state = self._state
        if state is _State.HEAD and self.requests and not self._buf:
            skipped = self._empty_lines(data, pos)
            if skipped:
                framing.append((self.offset + pos, skipped))
                return pos + skipped
        if state is _State.DATA_END:
            take = min(2 - len(self._buf), len(data) - pos)
        else:
            take = self._extent(data, pos, b"\r\n" if state is _State.SIZE else b"\r\n\r\n")
        start = len(self._buf)
        self._buf += data[pos : pos + take]
        used = self._complete(start, heads)
        if used is None:  # all of it belongs to the unfinished element: still pending
            framing.append((self.offset + pos, take))
            return pos + take
        consumed = used - start  # of what this call added
        framing.append((self.offset + pos, consumed))
        return pos + consumed

    def _extent(self, data: bytes, pos: int, end: bytes) -> int:
        """How much of ``data[pos:]`` to buffer: up to the first ``end`` (which may begin
        in the buffer), else all of it, within the element's bound. Only that much is
        copied: one segment of many small elements must not be copied once for each."""
        bound = (MAX_SIZE_LINE if end == b"\r\n" else MAX_HEAD) + 4
        tail = bytes(self._buf[-(len(end) - 1) :]) if self._buf else b""
        window = tail + data[pos : pos + bound]
        found = window.find(end)
        if found < 0:
            return min(len(data) - pos, bound)
        return max(1, found + len(end) - len(tail))

    def _empty_lines(self, data: bytes, pos: int) -> int:
        """CRLFs at ``data[pos:]`` between requests, skipped in one step (servers skip
        them too); more than ``MAX_EMPTY_LINES`` in a row are left to be refused."""
        n = 0
        while data.startswith(b"\r\n", pos + 2 * n) and self._empty < MAX_EMPTY_LINES:
            n += 1
            self._empty += 1
        return 2 * n

    def _complete(self, start: int, heads: list[FirstBytes]) -> int | None:
        """Act on the buffer if it now holds a whole element; how much of it that element
        is (the rest is given back), or None while it is not whole."""
        buf, state = self._buf, self._state
        if state is _State.HEAD:
            if self.requests and buf[:1] == b"\r":  # empty lines between requests
                if len(buf) < 2:
                    return None
                if buf[:2] != b"\r\n":
                    return self._refuse(heads, "malformed", "a lone CR between requests")
                if self._empty >= MAX_EMPTY_LINES:
                    return self._refuse(heads, "malformed", f"more than {MAX_EMPTY_LINES} "
                                        "empty lines between requests")  # fmt: skip
                self._empty += 1
                return self._done(2)
            end = buf.find(b"\r\n\r\n", max(0, start - 3))
            if end < 0:
                found = judge(bytes(buf))
                if found.outcome is Outcome.NEED_MORE and (
                    found.protocol == "http" or any(m.startswith(buf) for m in METHODS)
                ):  # (a lone "P" could still be HTTP/2's preface, or POST, PUT, PATCH)
                    return None
                if found.reason == "too_long" and len(buf) < MAX_HEAD + 4:
                    return None  # its end could still come within the bound, as judge reads it
                return self._head_refused(found, heads)
            head = bytes(buf[: end + 4])
            found = judge(head)
            if found.outcome is not Outcome.NAME or found.protocol != "http":
                return self._head_refused(found, heads)
            framing = _framing_of(head)
            if isinstance(framing, FirstBytes):
                heads.append(framing)
                self._state = _State.REFUSED
                return len(head)
            heads.append(found)
            self.requests += 1
            self._empty = 0
            self._switched = framing.switches
            if framing.chunked:
                self._state = _State.SIZE
            elif framing.length:
                self._state, self._left = _State.BODY, framing.length
            else:
                self._state = _State.HEAD
            return self._done(len(head))
        if state is _State.SIZE:
            return self._size_line(heads)
        if state is _State.DATA_END:
            if len(buf) < 2:
                return None if buf == b"\r" else self._refuse(heads, "malformed", "chunk data "
                                                              "not followed by CRLF")  # fmt: skip
            if buf[:2] != b"\r\n":
                return self._refuse(heads, "malformed", "chunk data not followed by CRLF")
            self._state = _State.SIZE
            return self._done(2)
        # TRAILER: empty, or fields up to an empty line
        if buf[:2] == b"\r\n":
            self._state = _State.HEAD
            return self._done(2)
        if len(buf) < 2 and buf == b"\r":
            return None
        end = buf.find(b"\r\n\r\n", max(0, start - 3))
        if end < 0:
            if len(buf) > MAX_HEAD:
                return self._refuse(heads, "too_long", f"a trailer over {MAX_HEAD:,} bytes")
            if lone_line_end(bytes(buf).removesuffix(b"\r")):
                return self._refuse(heads, "malformed", "a trailer line ended by a lone CR or LF")
            return None
        if end > MAX_HEAD:
            return self._refuse(heads, "too_long", f"a trailer over {MAX_HEAD:,} bytes")
        trailer = bytes(buf[: end + 4])
        fields = trailer[:-4]
        if lone_line_end(fields) or any(map(field_line_problem, fields.split(b"\r\n"))):
            return self._refuse(heads, "malformed", "a malformed trailer field")
        self._state = _State.HEAD
        return self._done(len(trailer))

    def _size_line(self, heads: list[FirstBytes]) -> int | None:
        buf = self._buf
        end = buf.find(b"\r\n")
        if end < 0:
            if b"\n" in buf or b"\r" in buf[:-1]:
                return self._refuse(heads, "malformed", _LONE)
            if len(buf) > MAX_SIZE_LINE + 1:  # (the line and its CR)
                return self._refuse(heads, "too_long", f"a size line over {MAX_SIZE_LINE} bytes")
            return None
        if end > MAX_SIZE_LINE:
            return self._refuse(heads, "too_long", f"a size line over {MAX_SIZE_LINE} bytes")
        line = bytes(buf[:end])
        size, semi, ext = line.partition(b";")
        if b"\r" in line or b"\n" in line:
            return self._refuse(heads, "malformed", _LONE)
        if not size or len(size) > MAX_HEX or not _HEX.issuperset(size):
            return self._refuse(heads, "malformed", f"chunk size {size[:20]!r}")
        if semi and not _EXT.issuperset(ext):
            return self._refuse(heads, "malformed", "a blank or control byte in a chunk extension")
        n = int(size, 16)
        if n:
            self._state, self._left = _State.DATA, n
        else:
            self._state = _State.TRAILER
        return self._done(end + 2)

    def _head_refused(self, found: FirstBytes, heads: list[FirstBytes]) -> int:
        after = _AFTER_SWITCH if self._switched else ""
        if found.protocol == "http2":  # the preface, whole or not yet
            found = _refuse("http2", "http2_prior_knowledge",
                            f"HTTP/2 without TLS: no name to read{after}")  # fmt: skip
        elif found.protocol != "http" or found.reason == "unknown_protocol":
            # not HTTP/1.x (a ClientHello, whole or not yet, or anything else)
            found = _refuse("", "unknown_protocol", "not an HTTP/1.x request where the next "
                            f"request begins{after}")  # fmt: skip
        heads.append(found)
        self._state = _State.REFUSED
        return len(self._buf)

    def _refuse(self, heads: list[FirstBytes], reason: str, detail: str) -> int:
        heads.append(_refuse("http", reason, detail))
        self._state = _State.REFUSED
        return len(self._buf)

    def _done(self, used: int) -> int:
        """The buffer's first ``used`` bytes were one element: drop them, give the rest
        back to the caller's data (it is read in the next state)."""
        del self._buf[:]
        return used


def _framing_of(head: bytes) -> _Framing | FirstBytes:
    """How the body after ``head`` (a head ``firstbytes`` accepted) is framed."""
    lines = head[:-4].split(b"\r\n")
    method, _, rest = lines[0].partition(b" ")
    version = rest.rpartition(b" ")[2]
    lengths: list[bytes] = []
    codings: list[bytes] = []
    upgrade = False
    for line in lines[1:]:
        field, _, value = line.partition(b":")
        name = field.lower()
        if name == b"content-length":
            lengths += [v.strip(b" \t") for v in value.split(b",")]
        elif name == b"transfer-encoding":
            codings.append(value.strip(b" \t").lower())
        elif name == b"upgrade":
            upgrade = True
    switches = method == b"CONNECT" or upgrade
    if codings and lengths:
        return _refuse("http", "malformed", "both Transfer-Encoding and Content-Length")
    if switches and (codings or any(v.strip(b"0") for v in lengths)):
        # Node's llhttp switches right after such a head, Go reads the body first
        return _refuse("http", "malformed", "a body on a CONNECT or Upgrade request")
    if codings:
        if version != b"HTTP/1.1":
            return _refuse("http", "malformed", "Transfer-Encoding in an HTTP/1.0 request")
        if codings != [b"chunked"]:
            return _refuse("http", "malformed", f"transfer coding {b', '.join(codings)[:40]!r}")
        return _Framing(True, 0, switches)
    if lengths:
        first = lengths[0]
        if not first or len(first) > MAX_LENGTH_DIGITS or not _DIGITS.issuperset(first):
            return _refuse("http", "malformed", f"Content-Length {first[:20]!r}")
        if any(v != first for v in lengths):
            return _refuse("http", "malformed", "Content-Length values that differ")
        return _Framing(False, int(first), switches)
    return _Framing(False, 0, switches)


def _merge(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for at, n in spans:
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == at:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((at, n))
    return tuple(out)
