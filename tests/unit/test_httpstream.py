"""A plain-HTTP connection read request by request (datapath.httpstream)."""

from __future__ import annotations

import itertools

import pytest

from egress.datapath.firstbytes import Outcome
from egress.datapath.httpstream import RequestStream, Step


def req(host: str, extra: str = "", method: str = "GET", version: str = "HTTP/1.1") -> bytes:
    return f"{method} /x {version}\r\nHost: {host}\r\n{extra}\r\n".encode()


def names(step: Step) -> list[str | None]:
    return [h.name if h.outcome is Outcome.NAME else h.reason for h in step.heads]


def fed(data: bytes, *cuts: int) -> tuple[list[str | None], Step, RequestStream]:
    """``data`` fed in pieces cut at ``cuts``: every head seen, and the last step."""
    s = RequestStream()
    seen: list[str | None] = []
    bounds = [0, *cuts, len(data)]
    step = Step((), 0, ())
    for a, b in itertools.pairwise(bounds):
        step = s.feed(data[a:b])
        seen += names(step)
    return seen, step, s


def test_every_request_of_a_kept_alive_connection_is_read() -> None:
    data = req("a.test") + req("b.test") + req("c.test")
    for cuts in ((), (5,), (len(req("a.test")),), (3, 40, 41, 60)):
        seen, step, _ = fed(data, *cuts)
        assert seen == ["a.test", "b.test", "c.test"], cuts
        assert step.pending == 0


def test_a_content_length_body_is_skipped_and_the_head_after_it_read() -> None:
    body = b"GET /x HTTP/1.1\r\nHost: hidden.test\r\n\r\n"  # bytes, not a request
    data = req("a.test", f"Content-Length: {len(body)}\r\n", "POST") + body + req("b.test")
    for cut in range(0, len(data), 7):
        seen, step, _ = fed(data, cut)
        assert seen == ["a.test", "b.test"]
        assert step.pending == 0


def test_chunked_bodies_are_framed_and_the_next_head_read() -> None:
    chunks = b"5;ext=1\r\nhello\r\n10\r\nGET / HTTP/1.1\r\n\r\n0\r\nX-Sum: 1\r\n\r\n"
    data = req("a.test", "Transfer-Encoding: chunked\r\n", "POST") + chunks + req("b.test")
    for cut in range(0, len(data), 5):
        seen, _, _ = fed(data, cut)
        assert seen == ["a.test", "b.test"], cut
    empty = req("a.test", "Transfer-Encoding: chunked\r\n", "PUT") + b"0\r\n\r\n"
    seen, _, _ = fed(empty + req("b.test"))
    assert seen == ["a.test", "b.test"]


def test_an_unfinished_head_is_pending_until_it_completes() -> None:
    s = RequestStream()
    first = req("a.test")
    step = s.feed(first + b"GET /y HTTP/1.1\r\nHo")
    assert names(step) == ["a.test"] and step.pending == len(b"GET /y HTTP/1.1\r\nHo")
    step = s.feed(b"st: b.test\r\n\r\n")
    assert names(step) == ["b.test"] and step.pending == 0


@pytest.mark.parametrize(
    "after",
    [
        b"\x16\x03\x01\x00\x05hello",  # a TLS record where a request begins
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"PRI * HT",  # refused before it is whole
        b" GET / HTTP/1.1\r\nHost: b.test\r\n\r\n",
        b"\nGET / HTTP/1.1\r\nHost: b.test\r\n\r\n",
        b"\rGET / HTTP/1.1\r\nHost: b.test\r\n\r\n",
        b"GET / HTTP/1.1\nHost: b.test\n\n",
    ],
)
def test_bytes_where_a_request_begins_that_are_no_request_are_refused(after: bytes) -> None:
    seen, step, s = fed(req("a.test") + after)
    assert seen[0] == "a.test" and len(seen) == 2 and seen[1] in (
        "unknown_protocol", "http2_prior_knowledge", "malformed",
    )  # fmt: skip
    assert step.refusal is not None
    assert names(s.feed(req("c.test"))) == []  # nothing more is read after a refusal


def test_empty_lines_between_requests_are_skipped_as_servers_skip_them() -> None:
    seen, step, _ = fed(req("a.test") + b"\r\n\r\n" + req("b.test"), len(req("a.test")) + 1)
    assert seen == ["a.test", "b.test"] and step.pending == 0
    # a run of them is no client's: bounded (each costs the reader a step)
    for cut in (0, len(req("a.test")) + 3):
        seen, step, _ = fed(req("a.test") + b"\r\n" * 5 + req("b.test"), cut)
        assert seen == ["a.test", "malformed"], cut
    seen, _, _ = fed(req("a.test") + b"\r\n" * 4 + req("b.test") + b"\r\n" * 4 + req("c.test"))
    assert seen == ["a.test", "b.test", "c.test"]


@pytest.mark.parametrize(
    "extra",
    [
        "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: gzip, chunked\r\n",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: identity\r\n",
        "Content-Length: 5\r\nContent-Length: 6\r\n",
        "Content-Length: 5, 6\r\n",
        "Content-Length: +5\r\n",
        "Content-Length: 0x5\r\n",
        "Content-Length: \r\n",
        "Content-Length: 1234567890123456\r\n",
    ],
)
def test_framing_two_servers_could_read_differently_is_refused(extra: str) -> None:
    seen, step, _ = fed(req("a.test", extra, "POST"))
    assert seen == ["malformed"] and step.refusal is not None


def test_chunked_on_http_1_0_is_refused() -> None:
    seen, _, _ = fed(req("a.test", "Transfer-Encoding: chunked\r\n", "POST", "HTTP/1.0"))
    assert seen == ["malformed"]


def test_the_same_content_length_twice_frames_as_one() -> None:
    seen, _, _ = fed(req("a.test", "Content-Length: 3\r\nContent-Length: 3\r\n", "POST")
                     + b"abc" + req("b.test"))  # fmt: skip
    assert seen == ["a.test", "b.test"]


@pytest.mark.parametrize(
    "chunks",
    [
        b"5 \r\nhello\r\n0\r\n\r\n",  # whitespace after the size
        b" 5\r\nhello\r\n0\r\n\r\n",
        b"0x5\r\nhello\r\n0\r\n\r\n",
        b"5\nhello\r\n0\r\n\r\n",  # a bare LF ends the size line
        b"5\r\nhelloXX0\r\n\r\n",  # data not followed by CRLF
        b"5\r\nhello\n0\r\n\r\n",
        b"11111111111111111\r\n",  # 17 hex digits
        b"5;a b\r\nhello\r\n0\r\n\r\n",  # whitespace in an extension
        b"5;a\nb\r\nhello\r\n0\r\n\r\n",
        b"0\r\nX-Sum 1\r\n\r\n",  # a trailer line with no colon
        b"0\r\nX-Sum: 1\n\r\n",
        b"",
    ],
)
def test_chunk_framing_servers_could_read_differently_is_refused(chunks: bytes) -> None:
    head = req("a.test", "Transfer-Encoding: chunked\r\n", "POST")
    if not chunks:  # a size line that never ends, past its bound
        chunks = b"5;" + b"a" * 2000
    seen, step, _ = fed(head + chunks + req("b.test"))
    assert seen[0] == "a.test" and step.refusal is not None, seen
    assert "b.test" not in seen


@pytest.mark.parametrize(
    "after",
    [
        b"\x81\x85abcd",  # a WebSocket frame
        b"\x00" + req("b.test"),  # Netty skips bytes up to 0x20 before a request line
        b"\x16\x03\x01\x00\x05hello",  # a TLS record (its fields can be such bytes too)
        b"\n" + req("b.test"),  # nginx and Node skip a LF
        b"\x85" + req("b.test"),  # Python's http.server splits at it
        b"SSH-2.0-x\r\n",
    ],
)
def test_after_connect_or_upgrade_what_is_no_request_is_refused(after: bytes) -> None:
    """Only the server's answer says whether it switched, and no first byte does (a
    server that did not reads past bytes the others would take for a frame): what comes
    after such a request is read as requests, and anything else refused."""
    for first in (
        req("a.test", "Upgrade: websocket\r\nConnection: Upgrade\r\n"),
        b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n",
    ):
        seen, step, _ = fed(first + after)
        assert seen[0] == "a.test" and step.refusal is not None, seen
        assert "b.test" not in seen
        assert "CONNECT or Upgrade" in step.refusal.detail


def test_a_method_cut_after_its_p_is_waited_for() -> None:
    for method in ("POST", "PUT", "PATCH"):
        data = req("a.test") + req("b.test", "Content-Length: 0\r\n", method)
        cut = len(req("a.test")) + 1
        seen, step, _ = fed(data, cut)
        assert seen == ["a.test", "b.test"] and step.pending == 0, method


def test_after_an_upgrade_the_server_refused_a_request_is_still_read() -> None:
    up = req("a.test", "Upgrade: websocket\r\nConnection: Upgrade\r\n")
    seen, _, _ = fed(up + req("b.test") + req("c.test"), len(up))
    assert seen == ["a.test", "b.test", "c.test"]


def test_the_bounds_do_not_depend_on_where_the_bytes_are_cut() -> None:
    from egress.datapath.firstbytes import MAX_HEAD
    from egress.datapath.httpstream import MAX_SIZE_LINE

    for extra in (-1, 0, 1, 2, 3, 4):  # heads ending near MAX_HEAD
        base = req("a.test", "X: \r\n")
        head = base[:-4] + b"y" * (MAX_HEAD + extra - len(base)) + b"\r\n\r\n"
        whole, _, _ = fed(head)
        bytewise, _, _ = fed(head, *range(1, len(head)))
        assert whole == bytewise, extra
    chunked = req("a.test", "Transfer-Encoding: chunked\r\n", "POST")
    for extra in (-1, 0, 1, 2, 3):  # size lines near MAX_SIZE_LINE
        line = b"0;" + b"e" * (MAX_SIZE_LINE - 2 + extra) + b"\r\n\r\n"
        whole, _, _ = fed(chunked + line)
        cuts = range(len(chunked) + 1, len(chunked) + len(line))
        bytewise, _, _ = fed(chunked + line, *cuts)
        assert whole == bytewise, extra


def test_h2c_after_an_upgrade_is_refused_at_its_preface() -> None:
    up = req("a.test", "Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\n")
    seen, _, _ = fed(up + b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert seen == ["a.test", "http2_prior_knowledge"]


def test_framing_spans_cover_heads_and_size_lines_not_bodies() -> None:
    head = req("a.test", "Transfer-Encoding: chunked\r\n", "POST")
    data = head + b"3\r\nabc\r\n0\r\n\r\n"
    step = RequestStream().feed(data)
    covered = bytearray(len(data))
    for at, n in step.framing:
        covered[at : at + n] = b"\x01" * n
    assert covered[: len(head) + 3] == b"\x01" * (len(head) + 3)  # head, "3\r\n"
    assert covered[len(head) + 3 : len(head) + 6] == b"\x00" * 3  # "abc"
    assert covered[len(head) + 6 :] == b"\x01" * (len(data) - len(head) - 6)


@pytest.mark.parametrize(
    "extra",
    ["Content-Length: 38\r\n", "Transfer-Encoding: chunked\r\n"],
)
def test_a_body_on_connect_or_upgrade_is_refused(extra: str) -> None:
    """Node's llhttp switches right after a CONNECT head whatever its Content-Length,
    Go reads the body first: two servers, two framings."""
    for first in (
        f"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n{extra}\r\n".encode(),
        req("a.test", f"Upgrade: websocket\r\nConnection: Upgrade\r\n{extra}"),
    ):
        seen, _, _ = fed(first + req("b.test"))
        assert seen == ["malformed"], first
    seen, _, _ = fed(req("a.test", "Upgrade: x\r\nContent-Length: 0\r\n") + req("b.test"))
    assert seen == ["a.test", "b.test"]


def test_a_trailer_over_the_bound_is_refused_however_it_is_cut() -> None:
    from egress.datapath.firstbytes import MAX_HEAD

    head = req("a.test", "Transfer-Encoding: chunked\r\n", "POST")
    trailer = b"0\r\nX: " + b"t" * (MAX_HEAD + 10) + b"\r\n\r\n"
    for cut in (None, len(head) + 100, len(head) + MAX_HEAD // 2):
        seen, _, _ = fed(head + trailer, *(() if cut is None else (cut,)))
        assert seen == ["a.test", "too_long"], cut
