"""Small value parsers: record types, durations, ports, CIDRs, upstreams."""

from __future__ import annotations

import ipaddress

import pytest

from egress.model import PortRange, Upstream
from egress.policy.rrtypes import (
    DATA_ONLY_TYPES,
    is_data_only,
    is_pseudo,
    names_of,
    type_name,
    type_number,
)
from egress.policy.values import (
    format_duration,
    parse_cidr,
    parse_duration,
    parse_port,
    parse_upstream,
)


@pytest.mark.parametrize(
    ("name", "number"),
    [
        ("A", 1),
        ("aaaa", 28),
        ("CNAME", 5),
        ("HTTPS", 65),
        ("TXT", 16),
        ("MX", 15),
        ("SRV", 33),
        ("KEY", 25),
        ("NULL", 10),
        ("ANY", 255),
        ("TYPE65280", 65280),
        ("type65", 65),
    ],
)
def test_type_number(name: str, number: int) -> None:
    assert type_number(name) == number


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("TXTT", "unknown record type 'TXTT' (did you mean TXT?)"),
        ("BOGUS", "unknown record type 'BOGUS'"),
        ("TYPE0", "out of range"),
        ("TYPE65536", "out of range"),
        ("TYPE", "unknown record type"),
        ("TYPE²", "unknown record type"),
    ],
)
def test_type_number_refuses(name: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        type_number(name)
    assert message in str(info.value)


def test_type_name() -> None:
    assert type_name(1) == "A"
    assert type_name(65) == "HTTPS"
    assert type_name(65280) == "TYPE65280"
    assert names_of(frozenset({65, 5, 28, 1})) == "A, AAAA, CNAME, HTTPS"
    assert names_of(frozenset()) == "none"


def test_data_only_and_pseudo_types() -> None:
    for number in (10, 251, 252, 255, 65280, 65534):
        assert is_data_only(number), number
        assert number in DATA_ONLY_TYPES
    for number in (1, 5, 16, 28, 65, 65279, 65535):
        assert not is_data_only(number), number
    assert [n for n in (41, 249, 250, 1) if is_pseudo(n)] == [41, 249, 250]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1s", 1), ("30s", 30), ("5m", 300), ("1h", 3600), ("1h30m", 5400), ("1h0m5s", 3605)],
)
def test_parse_duration(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (30, "duration '30' needs a unit: s, m or h"),
        ("30", "duration '30' needs a unit: s, m or h"),
        ("2d", "invalid duration '2d'"),
        ("", "invalid duration ''"),
        ("30 s", "invalid duration '30 s'"),
        ("5s1m", "invalid duration '5s1m'"),
        (True, "expected a duration"),
        (1.5, "expected a duration"),
    ],
)
def test_parse_duration_refuses(value: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(value)
    assert message in str(info.value)


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 5, 300, 5400, 3605)] == [
        "0s",
        "5s",
        "5m",
        "1h30m",
        "1h5s",
    ]


def test_parse_port() -> None:
    assert parse_port(443, ranges=False) == PortRange(443, 443)
    assert parse_port("443", ranges=False) == PortRange(443, 443)
    assert parse_port("8000-8100", ranges=True) == PortRange(8000, 8100)
    assert parse_port("1-65535", ranges=True) == PortRange(1, 65535)
    assert str(PortRange(8000, 8100)) == "8000-8100"


@pytest.mark.parametrize(
    ("value", "ranges", "message"),
    [
        (0, True, "port 0 is out of range 1-65535"),
        (65536, True, "port 65536 is out of range 1-65535"),
        (-1, True, "port -1 is out of range"),
        ("x", True, "invalid port 'x': expected a port number 1-65535 or a range"),
        ("x", False, "invalid port 'x': expected a port number"),
        ("8000-8100", False, "use a connect.allow CIDR for ranges"),
        ("9000-8000", True, "port range '9000-8000' is reversed: write 8000-9000"),
        ("1-70000", True, "port 70000 is out of range"),
        (True, True, "expected a port number 1-65535, got true"),
        (None, True, "got nothing (null)"),
        (4.5, True, "got 4.5"),
        ("9" * 40, True, "invalid port"),
    ],
)
def test_parse_port_refuses(value: object, ranges: bool, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_port(value, ranges=ranges)
    assert message in str(info.value)


def test_parse_cidr() -> None:
    assert parse_cidr("192.0.2.0/24") == ipaddress.ip_network("192.0.2.0/24")
    assert parse_cidr("192.0.2.7") == ipaddress.ip_network("192.0.2.7/32")
    assert parse_cidr("2001:db8::/32") == ipaddress.ip_network("2001:db8::/32")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("192.0.2.1/24", "has host bits set: the network is 192.0.2.0/24, or write 192.0.2.1/32"),
        ("2001:db8::1/32", "the network is 2001:db8::/32, or write 2001:db8::1/128"),
        ("300.1.2.3/8", "invalid CIDR '300.1.2.3/8'"),
        ("192.0.2.0/33", "invalid CIDR"),
        ("example.com", "invalid CIDR"),
        ("010.0.0.0/8", "invalid CIDR"),  # leading zeros are ambiguous (octal?) and refused
    ],
)
def test_parse_cidr_refuses(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_cidr(text)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "upstream"),
    [
        ("system", Upstream(None)),
        ("192.0.2.53", Upstream("192.0.2.53", 53)),
        ("192.0.2.53:5353", Upstream("192.0.2.53", 5353)),
        ("2001:db8::53", Upstream("2001:db8::53", 53)),
        ("[2001:db8::53]:5353", Upstream("2001:db8::53", 5353)),
        ("[2001:DB8:0::53]", Upstream("2001:db8::53", 53)),
    ],
)
def test_parse_upstream(text: str, upstream: Upstream) -> None:
    assert parse_upstream(text) == upstream


def test_upstream_str_round_trips() -> None:
    for text in ("system", "192.0.2.53:53", "[2001:db8::53]:5353"):
        assert str(parse_upstream(text)) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dns.google", "a host name would need DNS to find DNS"),
        ("192.0.2.53:0", "port 0 is out of range"),
        ("192.0.2.53:70000", "port 70000 is out of range"),
        ("[192.0.2.53]:53", "brackets are for IPv6"),
        ("0.0.0.0", "unspecified address"),
        ("[::]:53", "unspecified address"),
        ("", "invalid upstream ''"),
        ("System", "invalid upstream 'System'"),
    ],
)
def test_parse_upstream_refuses(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_upstream(text)
    assert message in str(info.value)
