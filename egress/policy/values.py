"""Parsers for the small value types of the policy language: durations, ports, CIDRs,
upstream servers.

Each takes the text (or number) a user wrote and returns the model value, or raises
ValueError whose message says what is wrong and, where one exists, what to write instead.
They know nothing about YAML positions; the validator attaches those.
"""

from __future__ import annotations

import ipaddress
import re

from egress.model import IPNetwork, PortRange, Upstream

_DURATION = re.compile(r"(?:([0-9]{1,6})h)?(?:([0-9]{1,6})m)?(?:([0-9]{1,6})s)?")
_DIGITS = re.compile(r"[0-9]{1,9}")
_RANGE = re.compile(r"([0-9]{1,5})-([0-9]{1,5})")
_BRACKETED = re.compile(r"\[([^\]]+)\](?::([0-9]{1,5}))?")
_HOST_PORT = re.compile(r"([0-9.]+):([0-9]{1,5})")

RANGE_NOT_HERE = (
    "port ranges are not allowed here: learned addresses are matched as "
    "address . protocol . port, one port each; use a connect.allow CIDR for ranges"
)


def parse_duration(value: object) -> int:
    """Seconds in ``30s``, ``5m``, ``1h`` or ``1h30m``; a bare number is refused."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected a duration like 30s, 5m or 1h, got {value!r}")
    if isinstance(value, int) or _DIGITS.fullmatch(value):
        raise ValueError(f"duration '{value}' needs a unit: s, m or h")
    match = _DURATION.fullmatch(value)
    if not value or match is None:
        raise ValueError(f"invalid duration '{value}': expected a number and a unit: 30s, 5m, 1h")
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def format_duration(seconds: int) -> str:
    """Inverse of :func:`parse_duration` for messages: 5400 -> ``1h30m``."""
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if n]
    return "".join(parts) or "0s"


def parse_port(value: object, *, ranges: bool) -> PortRange:
    """One port (``443`` or ``"443"``) or, when ``ranges``, a range ``"8000-8100"``."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected a port number 1-65535, got {_show(value)}")
    if isinstance(value, int) or _DIGITS.fullmatch(value):
        return _single(int(value))
    match = _RANGE.fullmatch(value)
    if match is None:
        expected = "a port number 1-65535 or a range like 8000-8100" if ranges else "a port number"
        raise ValueError(f"invalid port '{value}': expected {expected}")
    if not ranges:
        raise ValueError(f"port range '{value}': {RANGE_NOT_HERE}")
    first, last = _single(int(match.group(1))).first, _single(int(match.group(2))).first
    if first > last:
        raise ValueError(f"port range '{value}' is reversed: write {last}-{first}")
    return PortRange(first, last)


def _single(number: int) -> PortRange:
    if not 1 <= number <= 65535:
        raise ValueError(f"port {number} is out of range 1-65535")
    return PortRange(number, number)


def parse_cidr(text: str) -> IPNetwork:
    """An IPv4 or IPv6 network; a bare address means just that address (/32 or /128)."""
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError:
        pass
    try:
        loose = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ValueError(
            f"invalid CIDR '{text}': expected an address or network "
            "like 192.0.2.0/24 or 2001:db8::/32"
        ) from None
    address = text.partition("/")[0]
    host = f"{address}/{loose.max_prefixlen}"
    raise ValueError(
        f"CIDR '{text}' has host bits set: the network is {loose}, or write {host} for one address"
    )


def parse_upstream(text: str) -> Upstream:
    """``system``, ``IP``, ``IP:port``, ``[IPv6]:port`` or a bare IPv6 address."""
    if text == "system":
        return Upstream(host=None)
    host, port = _split_host_port(text)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"invalid upstream '{text}': expected 'system' or an IP address "
            "(192.0.2.53, 192.0.2.53:5353, 2001:db8::53 or [2001:db8::53]:53); "
            "a host name would need DNS to find DNS"
        ) from None
    if address.is_unspecified:
        raise ValueError(f"upstream '{text}' is the unspecified address; name a real server")
    if "[" in text and address.version == 4:
        raise ValueError(f"upstream '{text}': brackets are for IPv6 addresses; write {host}:{port}")
    return Upstream(host=str(address), port=_single(port).first)


def _split_host_port(text: str) -> tuple[str, int]:
    bracketed = _BRACKETED.fullmatch(text)
    if bracketed is not None:
        return bracketed.group(1), int(bracketed.group(2) or 53)
    host_port = _HOST_PORT.fullmatch(text)
    if host_port is not None:
        return host_port.group(1), int(host_port.group(2))
    return text, 53


def _show(value: object) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
