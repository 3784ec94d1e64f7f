"""The name a new TCP flow's first client bytes ask for: TLS SNI or HTTP/1.x Host.

Pure: the bytes the client has sent so far in, a ``FirstBytes`` out. Invariant 10 binds
an address learned from DNS to the names that produced it; this is the half that reads
the name a connection asks for (the other half, which names put the address into the
sandbox's set, is the resolver's). The bytes come from a workload an attacker controls,
so anything that is not a complete, well-formed, unambiguous request for one hostname is
a refusal with a reason, never an exception and never a guess:

- TLS (first byte 22): the ClientHello, reassembled over as many handshake records as it
  takes (``MAX_HELLO`` bytes at most). Its ``server_name`` must hold exactly one
  ``host_name``, a hostname, not an IP literal. A ClientHello with the ECH extension is
  refused (the name it shows is not the one it asks for), and so is any duplicated
  extension, since two readers could each see a different one.
- HTTP/1.x (a method token): the request line and headers up to the blank line
  (``MAX_HEAD`` bytes at most). The name is the request target's authority in absolute
  or authority form (a proxy request, ``CONNECT``), else the one Host header; two Host
  headers, a folded header line, or an absolute-form target whose authority differs from
  Host are refused. So is anything a lenient server could read as another request than
  this one does (an attacker's review sent one to Python's http.server): a line ended
  by LF or CR alone, a control byte or tab in the request line, a field name that is not
  a token, a control byte in a field value, and a target that is neither origin form
  (``/x``), ``*``, nor ``http://`` or ``https://`` absolute form: nginx, for one, takes
  the host of ``ws://x/`` as the request's. (``//x/y`` is a path to the servers that
  route by host, Go's and nginx's among them, and sloppy URLs make it: it stays.)
- HTTP/2 with prior knowledge (the connection preface) carries its authority in HPACK,
  which this does not read: refused. Anything else is refused as an unknown protocol.

``NEED_MORE`` means the bytes end inside the ClientHello or the header block: the caller
waits for more, within its own bound on segments, and refuses when that bound is hit.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from enum import Enum

MAX_HELLO = 16 * 1024  # a ClientHello (handshake body) this long is refused
MAX_HEAD = 16 * 1024  # so is an HTTP request line and header block
MAX_NAME = 253

TLS_HANDSHAKE = 22
CLIENT_HELLO = 1
EXT_SERVER_NAME = 0
EXT_ECH = 0xFE0D  # encrypted_client_hello (RFC 9849)
EXT_ECH_OUTER = 0xFD00  # ech_outer_extensions: only ever inside an inner ClientHello
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# RFC 9110 methods and the common extension ones; a request with any other token is
# refused as an unknown protocol rather than parsed as HTTP.
METHODS = frozenset(
    {b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"OPTIONS", b"TRACE", b"PATCH"}
)
# RFC 9110 5.6.2: the bytes of a token (a method, a field name)
_TCHAR = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
# Bytes no field value may hold (RFC 9110 5.5: HTAB is allowed there, CR and LF are not)
_VALUE_CTL = frozenset(range(0x20)) - {0x09} | {0x7F}
_LINE_CTL = _VALUE_CTL | {0x09, 0x20}  # ... nor a request line's parts: no tab, no space
# Hostname characters, with the underscore some real names carry: leniency here opens
# nothing, since the name must still be one the policy allows and this sandbox resolved.
_HOSTNAME = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-_")


class Outcome(Enum):
    NAME = "name"  # ``name`` is what the flow asks for
    NEED_MORE = "need_more"  # the bytes end inside the request: wait for more
    REFUSE = "refuse"  # ``reason`` says why


@dataclass(frozen=True, slots=True)
class FirstBytes:
    outcome: Outcome
    protocol: str  # "tls", "http", "http2" or "" when it could not tell
    name: str | None = None  # lowercase, no trailing dot, no port
    reason: str = ""  # a code: no_sni, ip_literal, ech, malformed, ...; "" for NAME
    detail: str = ""  # for a person: what exactly was wrong


def _refuse(protocol: str, reason: str, detail: str) -> FirstBytes:
    return FirstBytes(Outcome.REFUSE, protocol, None, reason, detail)


def _more(protocol: str) -> FirstBytes:
    return FirstBytes(Outcome.NEED_MORE, protocol)


def judge(data: bytes) -> FirstBytes:
    """What the first client bytes of a flow ask for (see the module docstring)."""
    if not data:
        return _more("")
    if data[0] == TLS_HANDSHAKE:
        return _tls(data)
    if HTTP2_PREFACE.startswith(data[: len(HTTP2_PREFACE)]):
        if len(data) < len(HTTP2_PREFACE):
            return _more("http2")
        return _refuse("http2", "http2_prior_knowledge", "HTTP/2 without TLS: no name to read")
    return _http(data)


# --- TLS -----------------------------------------------------------------------------------


def _tls(data: bytes) -> FirstBytes:
    """Reassemble the handshake bytes of the leading records, then read the ClientHello."""
    body = bytearray()
    pos = 0
    while True:
        if len(data) - pos < 5:
            return _more("tls")
        kind, major, length = data[pos], data[pos + 1], int.from_bytes(data[pos + 3 : pos + 5])
        if kind != TLS_HANDSHAKE:
            return _refuse("tls", "malformed", f"a record of type {kind} inside the ClientHello")
        if major != 3:
            return _refuse("tls", "malformed", f"record version {major}.{data[pos + 2]}")
        if length == 0 or length > 16384:
            return _refuse("tls", "malformed", f"a handshake record of {length} bytes")
        if len(data) - pos - 5 < length:
            # Without the whole record, still judge what its start already shows.
            early = _hello_header(bytes(body) + data[pos + 5 :])
            return early if early is not None else _more("tls")
        body += data[pos + 5 : pos + 5 + length]
        pos += 5 + length
        early = _hello_header(bytes(body))
        if early is not None:
            return early
        need = 4 + int.from_bytes(body[1:4])
        if len(body) >= need:
            # What follows the ClientHello (0-RTT early data, a ChangeCipherSpec) does not
            # change the name it asks for.
            return _client_hello(bytes(body[4:need]))


def _hello_header(body: bytes) -> FirstBytes | None:
    """A refusal as soon as the handshake header is wrong, else None."""
    if not body:
        return None
    if body[0] != CLIENT_HELLO:
        return _refuse("tls", "malformed", f"handshake message type {body[0]}, not ClientHello")
    if len(body) >= 4:
        length = int.from_bytes(body[1:4])
        if length > MAX_HELLO:
            return _refuse("tls", "too_long", f"a ClientHello of {length:,} bytes")
        if length < 38:
            return _refuse("tls", "malformed", f"a ClientHello of {length} bytes")
    return None


class _Short(Exception):
    """A length field points past its container."""


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise _Short
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def number(self, n: int) -> int:
        return int.from_bytes(self.take(n))

    def vector(self, size: int) -> bytes:
        return self.take(self.number(size))

    def done(self) -> bool:
        return self.pos == len(self.data)


def _client_hello(hello: bytes) -> FirstBytes:
    r = _Reader(hello)
    try:
        r.take(2 + 32)  # legacy_version, random
        session = r.vector(1)
        suites = r.vector(2)
        compression = r.vector(1)
        if len(session) > 32 or not suites or len(suites) % 2 or not compression:
            return _refuse("tls", "malformed", "bad session id, cipher suites or compression")
        if r.done():
            return _refuse("tls", "no_sni", "a ClientHello without extensions")
        extensions = _Reader(r.vector(2))
        if not r.done():
            return _refuse("tls", "malformed", "bytes after the extensions")
        seen: set[int] = set()
        sni: bytes | None = None
        while not extensions.done():
            kind = extensions.number(2)
            value = extensions.vector(2)
            if kind in seen:
                return _refuse("tls", "malformed", f"extension {kind} twice")
            seen.add(kind)
            if kind == EXT_ECH:
                return _refuse("tls", "ech", "Encrypted Client Hello: the real name is hidden")
            if kind == EXT_ECH_OUTER:
                return _refuse("tls", "malformed", "ech_outer_extensions in an outer ClientHello")
            if kind == EXT_SERVER_NAME:
                sni = value
    except _Short:
        return _refuse("tls", "malformed", "a length runs past the end of the ClientHello")
    if sni is None:
        return _refuse("tls", "no_sni", "no server_name extension")
    return _server_name(sni)


def _server_name(value: bytes) -> FirstBytes:
    r = _Reader(value)
    names: list[bytes] = []
    try:
        entries = _Reader(r.vector(2))
        if not r.done():
            return _refuse("tls", "malformed", "bytes after the server name list")
        while not entries.done():
            kind = entries.number(1)
            name = entries.vector(2)
            if kind != 0:
                return _refuse("tls", "malformed", f"server name of type {kind}")
            names.append(name)
    except _Short:
        return _refuse("tls", "malformed", "a length runs past the end of server_name")
    if len(names) != 1:
        return _refuse("tls", "no_sni" if not names else "malformed", f"{len(names)} host names")
    return _hostname("tls", names[0], "SNI")


# --- HTTP/1.x ------------------------------------------------------------------------------


def _http(data: bytes) -> FirstBytes:
    end = data.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
    # A lone CR or LF ends a line for some servers and not for others: refused as soon as
    # it is seen (a CR at the very end may still be followed by its LF).
    head = data[:end] if end >= 0 else data[: MAX_HEAD + 4].removesuffix(b"\r")
    if lone_line_end(head):
        method = data.partition(b" ")[0]
        if method in METHODS:
            return _refuse("http", "malformed", "a line ended by a lone CR or LF")
        return _unknown()
    if end < 0:
        if len(data) > MAX_HEAD:
            return _refuse("http", "too_long", f"no end of headers in {MAX_HEAD:,} bytes")
        method, space, _ = data.partition(b" ")
        if space:  # the method is all there: HTTP only if it is one
            return _more("http") if method in METHODS else _unknown()
        # Still inside the first token: HTTP only while it can grow into a method.
        return _more("http") if any(m.startswith(data) for m in METHODS) else _unknown()
    lines = data[:end].split(b"\r\n")
    request = lines[0].split(b" ")
    if request[0] not in METHODS:
        return _unknown()
    if len(request) != 3:
        return _refuse("http", "malformed", "a request line that is not METHOD TARGET VERSION")
    method, target, version = request
    if version not in (b"HTTP/1.0", b"HTTP/1.1"):
        return _refuse("http", "malformed", f"version {version[:16]!r}")
    if not target or not _LINE_CTL.isdisjoint(target):
        return _refuse("http", "malformed", "a control byte or tab in the request target")
    if not _plain_target(method, target):
        return _refuse("http", "malformed", f"request target {target[:40]!r}")
    hosts: list[bytes] = []
    for line in lines[1:]:
        if not line or line[:1] in (b" ", b"\t"):
            return _refuse("http", "malformed", "a folded or empty header line")
        problem = field_line_problem(line)
        if problem:
            return _refuse("http", "malformed", problem)
        field, _, value = line.partition(b":")
        if field.lower() == b"host":
            hosts.append(value.strip(b" \t"))
    if len(hosts) > 1:
        return _refuse("http", "host_conflict", f"{len(hosts)} Host headers")
    authority = _target_authority(method, target)
    if authority is None and method == b"CONNECT":
        return _refuse("http", "malformed", "CONNECT without host:port")
    if authority is not None:
        if hosts and _host_part(hosts[0]) != _host_part(authority):
            return _refuse("http", "host_conflict", "the request target and Host name differ")
        return _authority(authority)
    if not hosts:
        return _refuse("http", "no_host", "no Host header")
    return _authority(hosts[0])


def lone_line_end(data: bytes) -> bool:
    """``data`` holds a CR or LF that is not part of a CRLF: some servers end a line
    there and others do not (a request head's, or a trailer's)."""
    crlf = data.count(b"\r\n")
    return data.count(b"\n") != crlf or data.count(b"\r") != crlf


def field_line_problem(line: bytes) -> str:
    """What is wrong with a header or trailer field line for a reader as strict as any
    server: a name that is not a token, or a control byte in the value; "" if nothing."""
    field, colon, value = line.partition(b":")
    if not colon or not field or not _TCHAR.issuperset(field):
        return f"header line {line[:40]!r}"
    if not _VALUE_CTL.isdisjoint(value):
        return f"a control byte in header {field[:40]!r}"
    return ""


def _unknown() -> FirstBytes:
    return _refuse("", "unknown_protocol", "neither TLS nor an HTTP/1.x request")


def _plain_target(method: bytes, target: bytes) -> bool:
    """A request target every server reads alike: origin form, ``*`` for OPTIONS,
    ``http``/``https`` absolute form, or CONNECT's authority form."""
    if method == b"CONNECT":
        return True  # _target_authority reads it, or refuses it
    if target.startswith(b"/"):
        return True
    if target == b"*":
        return method == b"OPTIONS"
    return target[:8].lower().startswith((b"http://", b"https://"))


def _target_authority(method: bytes, target: bytes) -> bytes | None:
    """The authority of an absolute-form (``http://a.b/x``) or authority-form (CONNECT
    ``a.b:443``) request target; None for origin form (``/x``) and ``*``."""
    if method == b"CONNECT":
        return target if target and b"/" not in target else None
    low = target.lower()
    for scheme in (b"http://", b"https://"):
        if low.startswith(scheme):
            rest = target[len(scheme) :]
            for stop in (b"/", b"?", b"#"):
                rest = rest.split(stop, 1)[0]
            return rest.rsplit(b"@", 1)[-1]  # userinfo@ is not the host
    return None


def _host_part(authority: bytes) -> bytes:
    """``authority`` without its port, lowercase (a bracketed IPv6 literal kept whole)."""
    a = authority.strip().lower()
    if a.startswith(b"["):
        return a.split(b"]", 1)[0] + b"]"
    return a.rsplit(b":", 1)[0] if a.count(b":") == 1 else a


def _authority(authority: bytes) -> FirstBytes:
    host = _host_part(authority)
    if host.startswith(b"["):
        return _refuse("http", "ip_literal", "an IPv6 literal as the host")
    if authority.count(b":") == 1:
        port = authority.rsplit(b":", 1)[1]
        if port and not port.isdigit():
            return _refuse("http", "malformed", f"port {port[:8]!r}")
    return _hostname("http", host, "Host")


# --- names ---------------------------------------------------------------------------------


_ADDRESS_CHARS = frozenset(b"0123456789.")  # an IPv4 literal's; IPv6 ones have a ':'


def _hostname(protocol: str, raw: bytes, what: str) -> FirstBytes:
    """A hostname as a DNS name in lowercase, or a refusal: IP literals, empty labels,
    characters outside letters, digits and hyphen (and a trailing root dot)."""
    name = raw.lower()
    if name.endswith(b"."):
        name = name[:-1]
    if not name:
        return _refuse(protocol, "malformed", f"an empty {what}")
    if len(name) > MAX_NAME:
        return _refuse(protocol, "malformed", f"a {what} of {len(name)} bytes")
    text = name.decode("latin-1")
    if b":" in name or _ADDRESS_CHARS.issuperset(name):  # could be one: ask (rarely taken)
        try:
            ipaddress.ip_address(text)
        except ValueError:
            pass
        else:
            return _refuse(protocol, "ip_literal", f"{what} is an IP address: {text}")
    for label in name.split(b"."):
        if not label or len(label) > 63 or not _HOSTNAME.issuperset(label):
            return _refuse(protocol, "malformed", f"{what} {text[:64]!r} is not a hostname")
        if label[:1] == b"-" or label[-1:] == b"-":
            return _refuse(protocol, "malformed", f"{what} {text[:64]!r} is not a hostname")
    if name.split(b".")[-1].isdigit():
        return _refuse(protocol, "ip_literal", f"{what} {text!r} looks like an address")
    return FirstBytes(Outcome.NAME, protocol, text)
