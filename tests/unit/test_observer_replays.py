"""The observer's replays of allowed queries (observer.replays): what a repeat may skip."""

from __future__ import annotations

from test_packet import ipv4, tcp, udp

from egress.observer.replays import REPLAY_MAX, REPLAY_S, QueryReplays

QUERY = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07allowed\x04test\x00\x00\x01\x00\x01"


def packet(dns: bytes, sport: int = 40000) -> bytes:
    return ipv4(17, udp(sport, 53, dns))


def test_a_repeat_with_another_id_and_port_is_allowed_for_a_second() -> None:
    r = QueryReplays()
    r.remember(packet(QUERY), QUERY, now=10.0)
    repeat = packet(b"\xab\xcd" + QUERY[2:], sport=40001)
    assert r.allowed(repeat, 10.0 + REPLAY_S - 0.01)
    assert not r.allowed(repeat, 10.0 + REPLAY_S)
    other = QUERY[:-3] + b"\x1c\x00\x01"  # AAAA: another question
    assert not r.allowed(packet(other), 10.5)


def test_only_what_was_judged_is_kept() -> None:
    r = QueryReplays()
    r.remember(packet(QUERY), QUERY[:-1], now=0.0)  # not what the packet carries
    r.remember(ipv4(6, tcp(40000, 53, data=b"\x00\x1d" + QUERY)), QUERY, now=0.0)
    r.remember(ipv4(17, udp(40000, 53, QUERY), frag=0x2000), QUERY, now=0.0)
    assert len(r) == 0
    # a TCP segment whose bytes after its first two are a UDP query's: never a key
    assert not r.allowed(packet(QUERY), 0.5)
    long = QUERY + b"\0" * 600
    r.remember(packet(long), long, now=0.0)
    assert len(r) == 0


def test_bounded_and_cleared() -> None:
    r = QueryReplays()
    for i in range(REPLAY_MAX + 1):
        q = i.to_bytes(4, "big") + QUERY[4:]
        r.remember(packet(q), q, now=0.0)
    assert len(r) == 1  # emptied when full, then the newest kept
    r.clear()
    assert not r.allowed(packet(QUERY), 0.0)
