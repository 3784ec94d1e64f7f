"""egress.datapath.firstbytes: the name a flow's first client bytes ask for.

Real ClientHellos come from Python's ssl (TLS 1.2 and 1.3, through memory BIOs: no socket);
the odd ones are built here, field by field, from RFC 8446's layout."""

from __future__ import annotations

import random
import re
import ssl

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egress.datapath.firstbytes import MAX_HEAD, MAX_HELLO, Outcome, judge

HOSTNAME = re.compile(
    r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*$"
)


def real_hello(name: str | None, version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3) -> bytes:
    """The first flight of Python's TLS client for ``name`` (no SNI when None)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ctx.maximum_version = version
    tls = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


def ext(kind: int, value: bytes) -> bytes:
    return kind.to_bytes(2) + len(value).to_bytes(2) + value


def sni(*names: bytes, kind: int = 0) -> bytes:
    entries = b"".join(bytes([kind]) + len(n).to_bytes(2) + n for n in names)
    return ext(0, len(entries).to_bytes(2) + entries)


def hello(*extensions: bytes, records: int = 1) -> bytes:
    """A ClientHello with these extensions, in ``records`` TLS records."""
    body = b"\x03\x03" + bytes(32) + b"\x20" + bytes(32) + b"\x00\x04\x13\x01\x13\x02" + b"\x01\x00"
    exts = b"".join(extensions)
    body += len(exts).to_bytes(2) + exts
    handshake = b"\x01" + len(body).to_bytes(3) + body
    return frame(handshake, records)


def frame(handshake: bytes, records: int) -> bytes:
    size = -(-len(handshake) // records)
    chunks = [handshake[i : i + size] for i in range(0, len(handshake), size)]
    return b"".join(b"\x16\x03\x01" + len(c).to_bytes(2) + c for c in chunks)


def handshake_of(flight: bytes) -> bytes:
    """The handshake bytes of a one-record flight."""
    assert flight[0] == 22
    return flight[5 : 5 + int.from_bytes(flight[3:5])]


# --- TLS -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_a_real_client_hello_names_its_server(version: ssl.TLSVersion) -> None:
    got = judge(real_hello("Files.PythonHosted.org", version))
    assert (got.outcome, got.protocol, got.name) == (Outcome.NAME, "tls", "files.pythonhosted.org")


def test_every_cut_of_a_client_hello_waits_for_more() -> None:
    flight = real_hello("pypi.org")
    for cut in range(len(flight)):
        assert judge(flight[:cut]).outcome is Outcome.NEED_MORE, cut
    assert judge(flight).name == "pypi.org"


@pytest.mark.parametrize("records", [2, 3, 7])
def test_a_client_hello_over_several_records_is_reassembled(records: int) -> None:
    flight = frame(handshake_of(real_hello("pypi.org")), records)
    assert judge(flight).name == "pypi.org"
    cuts = [judge(flight[:cut]).outcome for cut in range(len(flight))]
    assert set(cuts) == {Outcome.NEED_MORE}


def test_what_follows_the_client_hello_does_not_change_its_name() -> None:
    # 0-RTT early data or a ChangeCipherSpec may follow in the same flight.
    flight = real_hello("pypi.org") + b"\x14\x03\x03\x00\x01\x01" + b"\x17\x03\x03\x00\x05hello"
    assert judge(flight).name == "pypi.org"


@pytest.mark.parametrize(
    ("flight", "reason"),
    [
        (hello(ext(0xFE0D, b"\x00" * 40), sni(b"cover.example.com")), "ech"),
        (hello(sni(b"a.example.com"), ext(0xFD00, b"\x02\x00\x0a")), "malformed"),
        (hello(ext(10, b"\x00\x02\x00\x1d")), "no_sni"),
        (hello(), "no_sni"),
        (hello(sni()), "no_sni"),
        (hello(sni(b"a.example.com", b"b.example.com")), "malformed"),  # two names
        (hello(sni(b"a.example.com"), sni(b"b.example.com")), "malformed"),  # two extensions
        (hello(sni(b"a.example.com", kind=1)), "malformed"),
        (hello(sni(b"192.0.2.7")), "ip_literal"),
        (hello(sni(b"2001:db8::1")), "ip_literal"),
        (hello(sni(b"1.2.3")), "ip_literal"),  # what inet_aton takes for 1.2.0.3
        (hello(sni(b"")), "malformed"),
        (hello(sni(b"a..example.com")), "malformed"),
        (hello(sni(b"-a.example.com")), "malformed"),
        (hello(sni(b"a.example.com\x00.evil.com")), "malformed"),
        (hello(sni(b"\xc3\xa9.example.com")), "malformed"),
        (hello(sni(b"a" * 64 + b".example.com")), "malformed"),
        (hello(sni(b"a." * 127 + b"com")), "malformed"),  # 257 bytes
    ],
)  # fmt: skip
def test_a_client_hello_that_names_no_one_hostname_is_refused(flight: bytes, reason: str) -> None:
    got = judge(flight)
    assert (got.outcome, got.protocol, got.reason) == (Outcome.REFUSE, "tls", reason), got
    assert got.name is None and got.detail


def test_a_client_hello_without_sni_from_a_real_client_is_refused() -> None:
    assert judge(real_hello(None)).reason == "no_sni"


def test_broken_records_and_handshakes_are_refused_at_once() -> None:
    good = real_hello("pypi.org")
    body = handshake_of(good)
    half = body[: len(body) // 2]
    assert judge(b"\x15\x03\x01\x00\x02\x02\x28").reason == "unknown_protocol"  # an alert
    cases = {
        "record version 2": b"\x16\x02\x00" + good[3:],
        "empty record": b"\x16\x03\x01\x00\x00" + good,
        "record over 16 KiB": b"\x16\x03\x01\x40\x01" + bytes(10),
        "ServerHello": frame(b"\x02" + body[1:], 1),
        "ClientHello over MAX_HELLO": frame(b"\x01" + (MAX_HELLO + 1).to_bytes(3), 1),
        "tiny ClientHello": frame(b"\x01\x00\x00\x05" + bytes(5), 1),
        "application data between records": frame(half, 1) + b"\x17\x03\x03\x00\x01\x00",
    }
    for what, data in cases.items():
        got = judge(data)
        assert got.outcome is Outcome.REFUSE and got.protocol == "tls", (what, got)


def test_a_length_past_the_end_is_malformed_not_a_crash() -> None:
    body = bytearray(handshake_of(real_hello("pypi.org")))
    session = 4 + 2 + 32
    body[session] = 200  # session id length beyond the ClientHello
    assert judge(frame(bytes(body), 1)).reason == "malformed"


# --- HTTP/1.x ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("head", "name"),
    [
        (b"GET / HTTP/1.1\r\nHost: pypi.org\r\n\r\n", "pypi.org"),
        (b"GET /simple/ HTTP/1.1\r\nUser-Agent: pip\r\nhOsT:  PyPI.org:80 \r\n\r\n", "pypi.org"),
        (b"GET http://pypi.org/simple/ HTTP/1.1\r\nHost: pypi.org\r\n\r\n", "pypi.org"),
        (b"GET http://pypi.org:8080?x HTTP/1.1\r\n\r\n", "pypi.org"),
        (b"GET http://user:pw@pypi.org/ HTTP/1.1\r\n\r\n", "pypi.org"),
        (b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n", "pypi.org"),
        (b"POST /x HTTP/1.0\r\nHost: pypi.org.\r\nContent-Length: 3\r\n\r\nabc", "pypi.org"),
        (b"OPTIONS * HTTP/1.1\r\nHost: pypi.org\r\n\r\n", "pypi.org"),
        (b"GET /a//b HTTP/1.1\r\nUser-Agent: a\tb \xe9\r\nHost: pypi.org\r\n\r\n", "pypi.org"),
        (b"GET //debian/dists HTTP/1.1\r\nHost: pypi.org\r\n\r\n", "pypi.org"),  # a sloppy URL
    ],
)  # fmt: skip
def test_an_http_request_names_its_host(head: bytes, name: str) -> None:
    got = judge(head)
    assert (got.outcome, got.protocol, got.name) == (Outcome.NAME, "http", name), got


@pytest.mark.parametrize(
    ("head", "reason"),
    [
        (b"GET / HTTP/1.1\r\nHost: a.example.com\r\nHost: b.example.com\r\n\r\n", "host_conflict"),
        (b"GET / HTTP/1.1\r\nHost: a.example.com\r\nhost: a.example.com\r\n\r\n", "host_conflict"),
        (b"GET http://a.example.com/ HTTP/1.1\r\nHost: b.example.com\r\n\r\n", "host_conflict"),
        (b"GET / HTTP/1.1\r\nX: y\r\n Host: b.example.com\r\n\r\n", "malformed"),  # folded
        (b"GET / HTTP/1.1\r\nHost : a.example.com\r\n\r\n", "malformed"),
        (b"GET / HTTP/1.1\r\nHost: a.example.com\r\nbad line\r\n\r\n", "malformed"),
        (b"GET / HTTP/1.1\r\n\r\n", "no_host"),
        (b"GET / HTTP/1.0\r\n\r\n", "no_host"),
        (b"GET / HTTP/1.1\r\nHost: 198.51.100.4\r\n\r\n", "ip_literal"),
        (b"GET / HTTP/1.1\r\nHost: [2001:db8::1]:80\r\n\r\n", "ip_literal"),
        (b"GET / HTTP/1.1\r\nHost: a.example.com:8o\r\n\r\n", "malformed"),
        (b"GET / HTTP/2.0\r\nHost: a.example.com\r\n\r\n", "malformed"),
        (b"GET /\r\nHost: a.example.com\r\n\r\n", "malformed"),
        (b"CONNECT / HTTP/1.1\r\nHost: a.example.com\r\n\r\n", "malformed"),
        (b"GET / HTTP/1.1\r\nHost: a b.example.com\r\n\r\n", "malformed"),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04", "http2_prior_knowledge"),
        (b"SSH-2.0-OpenSSH_9.2p1\r\n", "unknown_protocol"),
        (b"get / HTTP/1.1\r\nHost: a.example.com\r\n\r\n", "unknown_protocol"),
        (b"\x00\x01\x02", "unknown_protocol"),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD + b"\r\n\r\n", "too_long"),
        # What a lenient server reads otherwise (an attacker's review: Python's
        # http.server took the first head here, Host b.example.com; this read the second)
        (b"GET /x\tHTTP/1.1\nHost:\tb.example.com\n\nX HTTP/1.1\r\nHost: a.example.com\r\n\r\n",
         "malformed"),
        (b"GET / HTTP/1.1\nHost: a.example.com\n\n", "malformed"),  # LF alone, no end yet
        (b"GET / HTTP/1.1\r\nHost: a.example.com\n\r\n", "malformed"),
        (b"GET / HTTP/1.1\r\nX: a\rHost: b.example.com\r\nHost: a.example.com\r\n\r\n",
         "malformed"),
        (b"GET /a\tb HTTP/1.1\r\nHost: a.example.com\r\n\r\n", "malformed"),
        (b"GET /a\x0bb HTTP/1.1\r\nHost: a.example.com\r\n\r\n", "malformed"),
        (b"GET / HTTP/1.1\r\nX: a\x00b\r\nHost: a.example.com\r\n\r\n", "malformed"),
        (b"GET / HTTP/1.1\r\nHost\t: a.example.com\r\n\r\n", "malformed"),
        (b"GET / HTTP/1.1\r\nHo(st: a.example.com\r\n\r\n", "malformed"),
        (b"GET ws://b.example.com/ HTTP/1.1\r\nHost: a.example.com\r\n\r\n", "malformed"),
        (b"GET b.example.com/x HTTP/1.1\r\nHost: a.example.com\r\n\r\n", "malformed"),
        (b"GET * HTTP/1.1\r\nHost: a.example.com\r\n\r\n", "malformed"),
    ],
)  # fmt: skip
def test_an_http_request_without_one_clear_host_is_refused(head: bytes, reason: str) -> None:
    got = judge(head)
    assert got.outcome is Outcome.REFUSE and got.reason == reason and got.detail, got


def test_every_cut_of_an_http_request_waits_for_more() -> None:
    request = b"GET http://pypi.org/simple/ HTTP/1.1\r\nHost: pypi.org\r\nAccept: */*\r\n\r\n"
    for cut in range(len(request) - 1):  # the last byte completes the blank line
        assert judge(request[:cut]).outcome is Outcome.NEED_MORE, request[:cut]
    assert judge(request).name == "pypi.org"
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    assert {judge(preface[:cut]).outcome for cut in range(1, len(preface))} == {Outcome.NEED_MORE}


# --- bad input: no crash, no hang, one precise verdict ---------------------------------------


def check(data: bytes) -> None:
    got = judge(data)
    if got.outcome is Outcome.NAME:
        assert got.name is not None and HOSTNAME.match(got.name) and not got.reason, (data, got)
    elif got.outcome is Outcome.REFUSE:
        assert got.name is None and got.reason and got.detail, (data, got)
    else:
        assert got.name is None and not got.reason, (data, got)


def test_100k_random_and_mutated_first_packets() -> None:
    rng = random.Random(14)
    seeds = [
        real_hello("pypi.org"),
        real_hello("a.b.example.com", ssl.TLSVersion.TLSv1_2),
        frame(handshake_of(real_hello("x.example.com")), 3),
        hello(sni(b"a.example.com"), ext(0xFE0D, bytes(8))),
        b"GET http://pypi.org/ HTTP/1.1\r\nHost: pypi.org\r\n\r\n",
        b"CONNECT a.example.com:443 HTTP/1.1\r\n\r\n",
    ]
    for i in range(100_000):
        kind = i % 4
        if kind == 0:  # random bytes, sometimes starting like TLS or HTTP
            start = rng.choice([b"", b"\x16\x03\x01", b"GET ", b"PRI * "])
            data = start + rng.randbytes(rng.randrange(0, 600))
        else:
            data = bytearray(rng.choice(seeds))
            if kind == 1:  # flip a few bytes
                for _ in range(rng.randrange(1, 6)):
                    data[rng.randrange(len(data))] = rng.randrange(256)
            elif kind == 2:  # cut or extend
                data = data[: rng.randrange(len(data) + 1)] + rng.randbytes(rng.randrange(0, 40))
            else:  # a length field set to anything
                pos = rng.randrange(len(data) - 1)
                data[pos : pos + 2] = rng.randrange(65536).to_bytes(2)
        check(bytes(data))


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=2048))
def test_any_bytes_get_a_verdict(data: bytes) -> None:
    check(data)
    check(b"\x16\x03\x01" + data)
    check(b"GET / HTTP/1.1\r\nHost: " + data + b"\r\n\r\n")
