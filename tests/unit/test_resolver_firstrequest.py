"""A flow's first request put together from held segments, then judged (resolver.firstrequest)."""

from __future__ import annotations

import ipaddress
import itertools

from test_resolver_bindings import WEB, hello, matcher

from egress.resolver.bindings import Bindings
from egress.resolver.firstrequest import Decision, FirstRequests, Segment

IP = ipaddress.ip_address("203.0.113.10")
KEY = ("10.7.0.2", 40000, "203.0.113.10", 443)
ISN = 1000


def bindings() -> Bindings:
    b = Bindings()
    b.learn([IP], ["allowed.test"], WEB, 0.0, 60.0)
    return b


def segments(data: bytes, *cuts: int, first_id: int = 1) -> list[Segment]:
    """``data`` cut at ``cuts`` into segments, sequence numbers from ISN."""
    bounds = [0, *cuts, len(data)]
    return [
        Segment(first_id + i, KEY, IP, 443, ISN + a, data[a:b])
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]


def feed(fr: FirstRequests, segs: list[Segment], now: float = 1.0) -> list[Decision]:
    out: list[Decision] = []
    b, m = bindings(), matcher()
    for seg in segs:
        out += fr.feed(seg, b, m, now)
    return out


def test_nothing_is_released_until_the_name_is_known_then_every_segment_is() -> None:
    fr = FirstRequests()
    data = hello("allowed.test")
    segs = segments(data, 100, 300)
    assert feed(fr, segs[:2]) == [] and len(fr) == 1  # held: the ClientHello is not complete
    [d] = feed(fr, segs[2:])
    assert d.accept and d.packet_ids == (1, 2, 3) and d.verdict and d.verdict.name == "allowed.test"
    assert len(fr) == 0


def test_a_denied_name_drops_every_held_segment() -> None:
    fr = FirstRequests()
    [d] = feed(fr, segments(hello("denied.test"), 50, 200))
    assert not d.accept and d.packet_ids == (1, 2, 3)
    assert d.verdict is not None and d.verdict.reason == "name_not_allowed"


def test_segments_out_of_order_and_retransmitted_are_judged_as_one_stream() -> None:
    fr = FirstRequests()
    a, b, c = segments(b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n", 10, 25)
    again = Segment(9, KEY, IP, 443, a.seq, a.data)  # the same bytes again
    assert feed(fr, [a, c, again]) == []  # b missing: a gap, nothing judged
    [d] = feed(fr, [b])
    assert d.accept and d.packet_ids == (1, 3, 9, 2)


def test_a_bare_ack_passes_alone_and_a_held_one_goes_with_its_flow() -> None:
    fr = FirstRequests()
    [ack] = feed(fr, [Segment(7, KEY, IP, 443, ISN, b"")])
    assert ack.accept and ack.packet_ids == (7,) and ack.verdict is None
    first, rest = segments(b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n", 10)
    feed(fr, [first, Segment(8, KEY, IP, 443, ISN + 10, b"")])
    [d] = feed(fr, [rest])
    assert d.packet_ids == (1, 8, 2)


def test_overlapping_segments_with_other_bytes_refuse_the_flow() -> None:
    request = b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    for other in (
        Segment(5, KEY, IP, 443, ISN, b"PUT / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"),
        Segment(5, KEY, IP, 443, ISN + 5, b"HTTP/1.0"),  # a partial overlap
    ):
        fr = FirstRequests()
        first, _ = segments(request, 20)
        [d] = feed(fr, [first, other])
        assert not d.accept and d.verdict is not None and d.verdict.reason == "overlap"
        assert d.packet_ids == (1, 5)


def test_a_longer_retransmission_is_read_whole() -> None:
    # Copies that agree as far as both go: the receiver reads the longer one's extra
    # bytes after the first copy's, which is what is judged here too.
    fr = FirstRequests()
    request = b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    short, _ = segments(request, 10)
    [d] = feed(fr, [short, Segment(2, KEY, IP, 443, ISN, request)])
    assert d.accept and d.packet_ids == (1, 2)
    fr = FirstRequests()
    denied = b"GET / HTTP/1.1\r\nHost: denied.test\r\n\r\n"
    [d] = feed(fr, [short, Segment(2, KEY, IP, 443, ISN, denied)])
    assert not d.accept and d.verdict is not None and d.verdict.reason == "name_not_allowed"


def test_a_decided_flow_answers_its_retransmissions_alike() -> None:
    fr = FirstRequests()
    segs = segments(hello("denied.test"), 100)
    feed(fr, segs)
    [d] = feed(fr, [Segment(11, KEY, IP, 443, segs[0].seq, segs[0].data)])
    assert not d.accept and d.packet_ids == (11,) and d.verdict is None


def test_every_bound_fails_closed() -> None:
    data = hello("allowed.test")
    fr = FirstRequests(max_segments=3)  # segments
    decisions = feed(fr, segments(data, 10, 20, 30, 40))
    assert [(d.accept, d.verdict.reason if d.verdict else None) for d in decisions] == [
        (False, "incomplete"), (False, None), (False, None)  # the third, then the rest
    ]  # fmt: skip
    assert decisions[0].packet_ids == (1, 2, 3)
    fr = FirstRequests(max_segments=3)  # packets held: retransmissions of one segment
    first = segments(data, 10)[0]
    repeats = [Segment(i, KEY, IP, 443, ISN, first.data) for i in range(1, 13)]
    decisions = feed(fr, repeats)
    assert decisions[0].packet_ids == tuple(range(1, 13)) and not decisions[0].accept
    fr = FirstRequests(max_bytes=50)  # bytes
    d, *rest = feed(fr, segments(data, 60, 120))
    assert not d.accept and d.verdict is not None and d.verdict.reason == "incomplete"
    assert d.packet_ids == (1,) and [r.accept for r in rest] == [False, False]
    fr = FirstRequests(timeout_s=5.0)  # time
    feed(fr, segments(data, 60)[:1], now=1.0)
    assert fr.expire(5.9) == []
    [d] = fr.expire(6.0)
    assert not d.accept and d.packet_ids == (1,) and len(fr) == 0
    fr = FirstRequests(max_flows=2)  # flows waiting at once: the oldest goes
    for port in (1, 2, 3):
        key = ("10.7.0.2", port, "203.0.113.10", 443)
        out = fr.feed(Segment(port, key, IP, 443, ISN, data[:50]), bindings(), matcher(), 1.0)
    assert [(d.key[1], d.accept) for d in out] == [(1, False)] and len(fr) == 2


def test_a_complete_request_to_an_address_it_never_resolved_to_is_a_mismatch() -> None:
    fr = FirstRequests()
    other = ipaddress.ip_address("203.0.113.99")
    seg = Segment(1, ("10.7.0.2", 1, str(other), 443), other, 443, ISN, hello("allowed.test"))
    [d] = fr.feed(seg, bindings(), matcher(), 1.0)
    assert not d.accept and d.verdict is not None and d.verdict.reason == "not_resolved_here"


def test_a_new_connection_from_the_same_port_is_judged_not_given_the_old_pass() -> None:
    from egress.resolver.firstrequest import CONTINUE_BYTES, PASSED_S

    fr = FirstRequests()
    first = b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    [d] = feed(fr, segments(first))
    assert d.accept
    # Sent before the verdict, or connected again from the same port at once (the server
    # closed first; Linux's next sequence number for the same ports is just past the old
    # one): which it is, only conntrack knows, so it is a probe for the shell to re-run.
    again = b"GET / HTTP/1.1\r\nHost: denied.test\r\n\r\n"
    near = Segment(9, KEY, IP, 443, ISN + len(first) + 5000, again)
    assert feed(fr, [near], now=1.5) == [Decision((9,), True, KEY, probe=True)]
    fr.forget(KEY)  # it came back: a new connection's, judged as what it is
    [d] = feed(fr, [near], now=1.5)
    assert not d.accept and d.verdict and d.verdict.reason == "name_not_allowed"
    # Far from the judged bytes, or long after: a new flow at once, no probe.
    for seq, now in ((ISN + len(first) + CONTINUE_BYTES, 1.5), (ISN - 1, 1.5),
                     (ISN + len(first), 1.0 + PASSED_S + 0.01)):  # fmt: skip
        fr = FirstRequests()
        feed(fr, segments(first))
        [d] = feed(fr, [Segment(10, KEY, IP, 443, seq, again)], now=now)
        assert not d.probe and not d.accept and d.verdict, (seq, now)


def test_a_refused_flow_stays_refused_for_its_retransmissions() -> None:
    fr = FirstRequests()
    [d] = feed(fr, segments(hello("denied.test"), 100))
    assert not d.accept
    [again] = feed(fr, [segments(hello("denied.test"), 100)[0]], now=3600.0)
    assert again == Decision((1,), False, KEY)  # no new verdict: no second violation


def test_an_address_a_rule_with_check_names_off_resolved_is_reached_unread() -> None:
    b = Bindings()
    b.learn([IP], ["mirror.test"], WEB, 0.0, 60.0, checked=False)
    fr = FirstRequests()
    seg = Segment(1, KEY, IP, 443, ISN, b"\x00 no name in here at all")
    [d] = fr.feed(seg, b, matcher(), 1.0)
    assert d.accept and d.verdict is not None and "check_names: false" in d.verdict.detail
    [again] = fr.feed(Segment(2, KEY, IP, 443, ISN, seg.data), b, matcher(), 1.5)
    assert again.probe  # the pass is remembered like any other
    assert not b.unchecked(IP, 22, 1.0)  # on its rule's ports only
    [late] = FirstRequests().feed(Segment(3, KEY, IP, 443, ISN, seg.data), b, matcher(), 61.0)
    assert not late.accept  # the answer's timeout passed: read, and refused


def test_a_first_request_across_the_sequence_wrap_is_read_in_order() -> None:
    data = b"GET / HTTP/1.1\r\nHost: denied.test\r\n\r\n"
    top = 2**32 - 10
    a = Segment(1, KEY, IP, 443, top, data[:10])
    b = Segment(2, KEY, IP, 443, 0, data[10:])  # wrapped: comes after, not before
    fr = FirstRequests()
    [d] = feed(fr, [a, b])
    assert d.verdict is not None and d.verdict.reason == "name_not_allowed"
    assert d.verdict.name == "denied.test"


def test_the_segments_held_over_all_flows_are_bounded() -> None:
    fr = FirstRequests(max_held=3)
    part = hello("allowed.test")[:50]
    out = []
    for port in range(4):
        key = ("10.7.0.2", 40000 + port, "203.0.113.10", 443)
        out += fr.feed(Segment(port + 1, key, IP, 443, ISN, part), bindings(), matcher(), 1.0)
    [d] = out  # the fourth held packet refuses the flow waiting longest
    assert not d.accept and d.key[1] == 40000 and d.verdict and d.verdict.reason == "incomplete"
    assert len(fr) == 3


def test_after_the_queue_lost_segments_new_flows_are_refused_a_while() -> None:
    fr = FirstRequests()
    fr.refuse_new_until = 2.0
    [d] = feed(fr, segments(hello("allowed.test")), now=1.0)
    assert not d.accept and d.verdict and "lost segments" in d.verdict.detail
    [ok] = FirstRequests().feed(segments(hello("allowed.test"))[0], bindings(), matcher(), 2.0)
    assert ok.accept


def test_urgent_data_in_a_first_request_refuses_the_flow() -> None:
    fr = FirstRequests()
    data = b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    urgent = Segment(1, KEY, IP, 443, ISN, data, urgent=True)
    [d] = fr.feed(urgent, bindings(), matcher(), 1.0)
    assert not d.accept and d.verdict and "urgent" in d.verdict.detail


# --- plain HTTP, read request by request -------------------------------------------------

HTTP_KEY = ("10.7.0.2", 40001, "203.0.113.10", 80)


def http(host: str, extra: str = "", method: str = "GET") -> bytes:
    return f"{method} /x HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


class Conn:
    """One plain-HTTP connection's segments, in order, sequence numbers from ISN."""

    def __init__(self, fr: FirstRequests) -> None:
        self.fr, self.seq, self.ids = fr, ISN, itertools.count(100)

    def seg(self, data: bytes, read: bool = True, seq: int | None = None) -> Segment:
        at = self.seq if seq is None else seq
        if seq is None:
            self.seq += len(data)
        return Segment(next(self.ids), HTTP_KEY, IP, 80, at, data, read=read)

    def send(self, data: bytes, read: bool = True, now: float = 1.0) -> list[Decision]:
        return self.fr.feed(self.seg(data, read), bindings(), matcher(), now)


def opened(first: bytes = b"") -> Conn:
    conn = Conn(FirstRequests())
    [d] = conn.send(first or http("allowed.test"), read=False)
    assert d.accept and d.read and d.verdict and d.verdict.name == "allowed.test"
    assert not d.later
    return conn


def test_every_request_of_a_kept_alive_plain_http_flow_is_judged() -> None:
    conn = opened()
    [d] = conn.send(http("allowed.test"))
    assert d.accept and d.read and d.verdict and d.verdict.name == "allowed.test"
    assert d.later  # the flow passed before: not counted as a flow again
    [d] = conn.send(http("denied.test"))
    assert not d.accept and d.verdict and d.verdict.reason == "name_not_allowed"
    [d] = conn.send(http("allowed.test"))  # its later segments are reset, not read
    assert not d.accept and d.verdict is None


def test_a_request_pipelined_behind_the_first_is_judged_with_it() -> None:
    conn = Conn(FirstRequests())
    [d] = conn.send(http("allowed.test") + http("denied.test"), read=False)
    assert not d.accept and d.verdict and d.verdict.name == "denied.test"


def test_a_body_is_not_read_as_requests_and_the_head_after_it_is() -> None:
    body = http("denied.test")
    conn = opened(http("allowed.test", f"Content-Length: {len(body) + 4}\r\n", "POST"))
    [d] = conn.send(body[:10])
    assert d.accept and d.read and d.verdict is None  # a body's bytes: released at once
    [d] = conn.send(body[10:] + b"1234")
    assert d.accept and d.read
    [d] = conn.send(http("denied.test"))
    assert not d.accept and d.verdict and d.verdict.reason == "name_not_allowed"


def test_a_head_over_two_segments_is_held_whole_then_judged() -> None:
    conn = opened()
    second = http("denied.test")
    assert conn.send(second[:20]) == [] and len(conn.fr) == 1
    [d] = conn.send(second[20:])
    assert not d.accept and d.packet_ids == (101, 102)
    conn = opened()
    assert conn.send(second[:20].replace(b"GET", b"PUT")) == []
    [d] = conn.send(http("allowed.test")[20:])
    assert d.accept and d.packet_ids == (101, 102)


def test_segments_past_a_gap_wait_for_it_and_are_read_in_order() -> None:
    conn = opened()
    a, b = conn.seg(http("allowed.test")), conn.seg(http("denied.test"))
    assert conn.fr.feed(b, bindings(), matcher(), 1.0) == []  # ahead: held
    [d] = conn.fr.feed(a, bindings(), matcher(), 1.0)
    assert not d.accept and set(d.packet_ids) == {a.packet_id, b.packet_id}


def test_a_retransmission_must_agree_where_requests_are_framed() -> None:
    body = b"x" * 10
    first = http("allowed.test", f"Content-Length: {len(body)}\r\n", "POST")
    conn = opened(first + body)
    # The body again with other bytes: it frames nothing, the server keeps one copy.
    [d] = conn.fr.feed(conn.seg(b"y" * 10, seq=ISN + len(first)), bindings(), matcher(), 1.0)
    assert d.accept
    forged = first.replace(b"allowed.test", b"denied..test")  # the same length
    [d] = conn.fr.feed(conn.seg(forged, seq=ISN), bindings(), matcher(), 1.0)
    assert not d.accept and d.verdict and d.verdict.reason == "overlap"


def test_a_read_segment_of_a_stream_not_known_is_reset_without_a_verdict() -> None:
    fr = FirstRequests()
    [d] = fr.feed(Segment(5, HTTP_KEY, IP, 80, ISN, http("allowed.test"), read=True),
                  bindings(), matcher(), 1.0)  # fmt: skip
    assert not d.accept and d.verdict is None


def test_a_segment_queued_before_the_pass_is_a_probe_and_a_far_one_a_new_flow() -> None:
    conn = opened()
    near = conn.seg(http("allowed.test"), read=False)
    assert conn.fr.feed(near, bindings(), matcher(), 1.0) == [
        Decision((near.packet_id,), True, HTTP_KEY, probe=True)
    ]
    far = conn.seg(http("denied.test"), read=False, seq=ISN + 10_000_000)
    [d] = conn.fr.feed(far, bindings(), matcher(), 1.0)
    assert not d.accept and d.verdict and d.verdict.reason == "name_not_allowed"
    assert not conn.fr.reads(HTTP_KEY)


def test_after_connect_a_tunnel_is_refused_not_let_through_unread() -> None:
    conn = opened(b"CONNECT allowed.test:80 HTTP/1.1\r\nHost: allowed.test:80\r\n\r\n")
    [d] = conn.send(b"\x16\x03\x01\x00\x05hello")
    assert not d.accept and d.verdict and d.verdict.reason == "unknown_protocol"


def test_a_read_flow_holding_bytes_is_refused_in_time() -> None:
    conn = opened()
    assert conn.send(http("allowed.test")[:10], now=2.0) == []
    assert conn.fr.expire(6.9) == []
    [d] = conn.fr.expire(7.0)
    assert not d.accept and d.verdict and d.verdict.reason == "incomplete"
    assert len(conn.fr) == 0


def test_what_the_queue_lost_is_waited_for_then_dropped_quietly_never_a_violation() -> None:
    conn = opened()
    lost = conn.seg(http("allowed.test"))  # never arrives: the queue overflowed
    past = [conn.seg(http("allowed.test")) for _ in range(9)]
    out = [d for seg in past for d in conn.fr.feed(seg, bindings(), matcher(), 1.0)]
    assert [(d.packet_ids, d.quiet, d.verdict) for d in out] == [((past[8].packet_id,), True,
                                                                  None)]  # fmt: skip
    [d] = conn.fr.expire(6.0)  # the gap never filled: the rest goes too, quietly
    assert d.quiet and not d.accept and len(d.packet_ids) == 8 and len(conn.fr) == 0
    [d] = conn.fr.feed(lost, bindings(), matcher(), 6.5)  # sent again: read, and on
    assert d.accept and d.read


def test_copies_past_a_gap_with_other_bytes_refuse_the_flow() -> None:
    conn = opened()
    conn.seg(http("allowed.test"))  # the gap
    first = conn.seg(http("allowed.test"))
    other = Segment(99, HTTP_KEY, IP, 80, first.seq, http("allowed.tesu"), read=True)
    assert conn.fr.feed(first, bindings(), matcher(), 1.0) == []
    [d] = conn.fr.feed(other, bindings(), matcher(), 1.0)
    assert not d.accept and d.verdict and d.verdict.reason == "overlap"
    assert set(d.packet_ids) == {first.packet_id, 99}


def test_framing_bytes_kept_are_bounded_per_flow() -> None:
    from egress.resolver.firstrequest import KEEP_BYTES

    conn = opened()
    for _ in range(2000):
        [d] = conn.send(http("allowed.test"))
        assert d.accept
    r = conn.fr._reading[HTTP_KEY]
    assert r.kept <= KEEP_BYTES and conn.fr._kept == r.kept and r.dropped
    # a retransmission of bytes no longer kept is refused, one of kept bytes is not
    tail = http("allowed.test")
    [d] = conn.fr.feed(conn.seg(tail, seq=conn.seq - len(tail)), bindings(), matcher(), 1.0)
    assert d.accept
    [d] = conn.fr.feed(conn.seg(tail, seq=ISN), bindings(), matcher(), 1.0)
    assert not d.accept and d.verdict is None  # cannot be told: reset, no violation


def test_a_held_flow_forgotten_for_a_reconnect_gets_its_verdicts() -> None:
    conn = opened()
    assert conn.send(http("allowed.test")[:10]) == []  # held: an unfinished head
    far = Segment(900, HTTP_KEY, IP, 80, ISN + 10_000_000, b"")  # a reconnect's bare ACK
    out = conn.fr.feed(far, bindings(), matcher(), 4.0)
    assert [(d.packet_ids, d.accept) for d in out] == [((101,), False), ((900,), True)]


def test_a_first_request_waiting_past_a_gap_keeps_its_bounds() -> None:
    head = http("allowed.test")
    a1 = Segment(1, HTTP_KEY, IP, 80, ISN, head[:10])
    past = Segment(2, HTTP_KEY, IP, 80, ISN + len(head) + 100, b"x")  # past a gap
    a2 = Segment(3, HTTP_KEY, IP, 80, ISN + 10, head[10:])  # completes the head
    fr = FirstRequests(max_segments=3)
    out = [d for seg in (a1, past, a2) for d in fr.feed(seg, bindings(), matcher(), 1.0)]
    assert [(d.accept, d.verdict.reason if d.verdict else None) for d in out] == [
        (False, "incomplete")
    ]
    fr = FirstRequests(max_segments=4)  # within the bounds: it waits for the gap
    assert [d for seg in (a1, past, a2) for d in fr.feed(seg, bindings(), matcher(), 1.0)] == []


def test_a_long_heads_first_segment_sent_again_agrees_and_a_bodys_passes() -> None:
    conn = opened()
    head = http("allowed.test", "Cookie: " + "c" * 12000 + "\r\n", "POST")
    body = b"b" * 30000
    start = conn.seq
    data = head.replace(b"POST /x", b"POST /y")[:-2] + b"Content-Length: 30000\r\n\r\n" + body
    data += http("allowed.test") * 3
    for i in range(0, len(data), 1448):
        assert all(d.accept for d in conn.send(data[i : i + 1448]))
    again = conn.seg(data[:1448], seq=start)  # the head's first segment, sent again
    [d] = conn.fr.feed(again, bindings(), matcher(), 1.0)
    assert d.accept  # within what is kept
    at = start + len(data) - len(body) - 3 * len(http("allowed.test")) + 100
    [d] = conn.fr.feed(conn.seg(b"z" * 500, seq=at), bindings(), matcher(), 1.0)
    assert d.accept  # body bytes frame nothing


def test_urgent_data_past_a_gap_is_refused() -> None:
    conn = opened()
    second = http("allowed.test")
    first = conn.seg(second[:10])
    rest = Segment(77, HTTP_KEY, IP, 80, first.seq + 10, second[10:], urgent=True, read=True)
    out = conn.fr.feed(rest, bindings(), matcher(), 1.0)
    out += conn.fr.feed(first, bindings(), matcher(), 1.0)
    assert [(d.accept, d.verdict.reason if d.verdict else None) for d in out] == [
        (False, "malformed"),
        (False, None),  # the bytes before it, of a refused flow: reset
    ]


def test_a_first_write_ending_inside_an_element_goes_on_unmarked() -> None:
    """Nothing of the flow was released (its first segment ends inside a chunk-size
    line), so conntrack has not marked it read: its next segment comes unmarked and is
    its next bytes, not a new connection's first request."""
    conn = Conn(FirstRequests())
    head = http("allowed.test", "Transfer-Encoding: chunked\r\n", "POST")
    assert conn.send(head + b"6", read=False) == []  # held: "6" may go on
    [d] = conn.send(b"4\r\n" + b"x" * 100 + b"\r\n0\r\n\r\n", read=False)
    assert d.accept and d.read and d.packet_ids == (100, 101)
    assert d.verdict and d.verdict.name == "allowed.test"
    [d] = conn.send(http("allowed.test"), read=False)  # marked read by now: a probe
    assert d.probe


def test_a_gap_long_after_the_flow_began_is_waited_for_its_own_time() -> None:
    conn = opened()
    conn.seg(http("allowed.test"))  # lost
    late = conn.seg(http("allowed.test"))
    assert conn.fr.feed(late, bindings(), matcher(), 100.0) == []
    assert conn.fr.expire(100.01) == []  # not the flow's start, 99 s before
    [d] = conn.fr.expire(105.0)
    assert d.quiet
